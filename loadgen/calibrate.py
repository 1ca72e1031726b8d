"""Scale the papers' GPU SLOs to the machine under test by the ratio of decode step times.

The papers' SLOs (e.g. TTFT 0.4 s, TPOT 0.2 s) are set for OPT-13B on A100s, where one
decode step of a moderate batch takes a few tens of milliseconds. On this CPU a step of the
default model takes longer, so the same deadlines would mean "several steps" there and
"less than one step" here. We keep the deadlines' meaning in *steps*:

    slo_scale = t_decode_step(this target) / t_decode_step(reference GPU profile)

both for a reference batch of `REF_BATCH` decode rows at `REF_CONTEXT` tokens of context
(close to the CPU-scaled ShareGPT request). The target's time is measured on the loaded
engine (a few warm decode steps, median) or taken from its cost model (the simulator).
"""

from __future__ import annotations

import statistics
import time

REF_BATCH = 16
REF_CONTEXT = 128
REFERENCE_PROFILE = "opt-13b-a100-40gb"  # BROS's OPT-13B / A100 setup


def reference_step_s(profile: str = REFERENCE_PROFILE) -> float:
    from loadgen.factory import load_cost_model

    return load_cost_model(profile).estimate([], [(1, REF_CONTEXT)] * REF_BATCH)


def model_step_s(cost) -> float:
    return cost.estimate([], [(1, REF_CONTEXT)] * REF_BATCH)


def measure_engine_step_s(engine, steps: int = 8, rounds: int = 3) -> float:
    """The fastest of `rounds` medians of pure-decode step times (REF_BATCH rows at about
    REF_CONTEXT tokens): the minimum filters out other processes competing for the cores."""
    return min(_median_step_s(engine, steps, r) for r in range(rounds))


def _median_step_s(engine, steps: int, round_: int) -> float:
    from engine import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(REF_BATCH):
        prompt = [(97 + 13 * i + 7 * j) % vocab for j in range(REF_CONTEXT - steps // 2)]
        engine.add_request(f"calibrate-{round_}-{i}", prompt, params)
    times = []
    while engine.has_unfinished():
        decode_only = all(r.is_prefill_done for r in engine.scheduler.running) and not engine.scheduler.waiting
        t0 = time.perf_counter()
        engine.step()
        if decode_only and len(engine.scheduler.running) == REF_BATCH:
            times.append(time.perf_counter() - t0)
    if not times:
        cfg = engine.config
        raise ValueError(
            f"could not measure a decode step of {REF_BATCH} rows at ~{REF_CONTEXT} tokens: it needs "
            f"max_num_seqs >= {REF_BATCH} (it is {cfg.max_num_seqs}) and a KV pool holding "
            f"{REF_BATCH} x {REF_CONTEXT + steps} tokens at once (it holds "
            f"{engine.scheduler.kv.capacity_tokens()}); give a number to --slo-scale instead of 'auto'"
        )
    return statistics.median(times)


def slo_scale(target_step_s: float, profile: str = REFERENCE_PROFILE) -> dict:
    ref = reference_step_s(profile)
    return {
        "slo_scale": target_step_s / ref,
        "target_step_s": target_step_s,
        "reference_step_s": ref,
        "reference_profile": profile,
        "ref_batch": REF_BATCH,
        "ref_context": REF_CONTEXT,
    }
