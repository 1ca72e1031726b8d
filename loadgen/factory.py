"""Build targets, prompt builders and workload configs from command-line arguments."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass
from pathlib import Path

from loadgen.arrivals import ArrivalSpec
from loadgen.prompts import PromptBuilder
from loadgen.targets.base import StepTarget
from loadgen.workloads.build import WorkloadConfig
from loadgen.workloads.sources import HumanSpeeds

PROFILE_DIR = Path(__file__).parent / "sim" / "profiles"
DEFAULT_SIM_PROFILE = "opt-13b-a100-40gb"


@dataclass
class TargetBundle:
    target: StepTarget
    prompts: PromptBuilder
    max_len: int | None
    tokenizer: object = None


def load_cost_model(name_or_path: str):
    """A cost-model file, or the name of a shipped profile (loadgen/sim/profiles/NAME.json)."""
    from engine.cost_model import CostModel

    p = Path(name_or_path)
    if not p.is_file():
        shipped = PROFILE_DIR / f"{name_or_path}.json"
        if not shipped.is_file():
            names = sorted(f.stem for f in PROFILE_DIR.glob("*.json"))
            raise ValueError(f"no cost model file {name_or_path!r} and no shipped profile of that name ({names})")
        p = shipped
    return CostModel.load(p)


def policy_options(policy: str, cost_model=None, default_slo=None) -> dict:
    """The options a policy's constructor accepts among those we can offer (cost model, SLO)."""
    from engine.scheduling import policy_class

    accepted = inspect.signature(policy_class(policy).__init__).parameters
    offer = {"cost_model": cost_model, "default_slo": default_slo}
    return {k: v for k, v in offer.items() if k in accepted and v is not None}


def engine_config(args: argparse.Namespace, policy: str):
    from engine import EngineConfig

    cfg = {"model": args.model, "dtype": args.dtype, "policy": policy, "seed": args.seed}
    for name in (
        "kv_cache_gib",
        "num_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "num_threads",
        "kv_heads_expand",
    ):
        if getattr(args, name, None) is not None:
            cfg[name] = getattr(args, name)
    return EngineConfig(**cfg)


def inproc_target(args: argparse.Namespace, policy: str, default_slo=None) -> TargetBundle:
    from loadgen.targets.inproc import InprocTarget
    from loadgen.workloads.random_tokens import special_token_ids

    cost = load_cost_model(args.cost_model) if getattr(args, "cost_model", None) else None
    target = InprocTarget.from_config(engine_config(args, policy), policy_options(policy, cost, default_slo))
    eng = target.engine
    mc = eng.model_config
    exclude = special_token_ids(eng.tokenizer, extra=[mc.bos_token_id, *mc.eos_token_ids])
    prompts = PromptBuilder(mc.vocab_size, args.seed, exclude, eng.tokenizer)
    return TargetBundle(target, prompts, eng.max_model_len, eng.tokenizer)


def sim_target(args: argparse.Namespace, policy: str, default_slo=None) -> TargetBundle:
    from loadgen.sim.cluster import ClusterSpec, SimTarget
    from loadgen.sim.worker import SimWorker

    cost = load_cost_model(args.cost_model or DEFAULT_SIM_PROFILE)
    spec = worker_spec(args, cost.meta)
    opts = policy_options(policy, cost, default_slo)
    workers = [SimWorker(f"w{i}", spec, cost, policy, opts) for i in range(args.workers)]
    bw = args.kv_bandwidth_gbps * 1e9 if args.kv_bandwidth_gbps else None
    target = SimTarget(workers, ClusterSpec(args.placement, bw))
    return TargetBundle(target, PromptBuilder(spec.vocab_size, args.seed), spec.max_model_len)


def worker_spec(args: argparse.Namespace, meta: dict):
    from loadgen.sim.worker import WorkerSpec

    block = int(meta.get("block_size", 16))
    num_blocks = args.num_blocks or (
        int(meta["kv_capacity_tokens"]) // block + 1 if "kv_capacity_tokens" in meta else 4096
    )
    return WorkerSpec(
        num_blocks=num_blocks,
        block_size=block,
        max_num_seqs=args.max_num_seqs or 128,
        max_num_batched_tokens=args.max_num_batched_tokens or 2048,
        max_model_len=args.max_model_len or int(meta.get("max_model_len", 2048)),
        kv_bytes_per_token=int(meta.get("kv_bytes_per_token", 0)),
        hidden_size=int(meta.get("hidden_size", 0)),
        head_dim=int(meta.get("head_dim", 0)),
        num_kv_heads=int(meta.get("num_kv_heads", 0)),
    )


def workload_config(
    args: argparse.Namespace,
    *,
    max_len: int | None,
    slo_scale: float,
    rate: float | None = None,
    seed: int | None = None,
) -> WorkloadConfig:
    arrival = ArrivalSpec(args.arrival, rate if rate is not None else args.rate, args.cv, args.trace, args.users)
    return WorkloadConfig(
        name=args.workload,
        arrival=arrival,
        duration_s=args.duration,
        seed=args.seed if seed is None else seed,
        length_scale=args.length_scale,
        slo_scale=slo_scale,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        max_len=max_len,
        rt_profile=args.rt_profile,
        dataset_path=args.dataset,
        be_batch=args.be_batch,
        be_refill=args.be_refill,
        turns_mean=args.turns_mean,
        speeds=HumanSpeeds(args.reading_wpm, args.typing_wpm),
    )
