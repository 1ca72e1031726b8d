"""Build targets, prompt builders and workload configs from command-line arguments."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, replace
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
    policy_flags: dict | None = None  # policy options given on the command line


def cost_model_file(name_or_path: str) -> Path:
    """A cost-model file, or the file of a shipped profile (loadgen/sim/profiles/NAME.json)."""
    p = Path(name_or_path)
    if not p.is_file():
        shipped = PROFILE_DIR / f"{name_or_path}.json"
        if not shipped.is_file():
            names = sorted(f.stem for f in PROFILE_DIR.glob("*.json"))
            raise ValueError(f"no cost model file {name_or_path!r} and no shipped profile of that name ({names})")
        p = shipped
    return p


def load_cost_model(name_or_path: str):
    """A cost-model file, or the name of a shipped profile (loadgen/sim/profiles/NAME.json)."""
    from engine.cost_model import CostModel

    return CostModel.load(cost_model_file(name_or_path))


# command-line options a policy may accept (BROS's; ellm's prefix source, layer split and layer count;
# aptserve's priced conversions)
POLICY_FLAGS = (
    "min_be_share",
    "token_group",
    "be_fills_rt_ends",
    "be_order",
    "source",
    "layer_split",
    "num_layers",
    "price_switches",
)
# a policy option whose command-line name is not its constructor's: the engine's (and the worker's) name
FLAG_NAMES = {"price_switches": "aptserve_price_switches"}


def policy_flags(args: argparse.Namespace) -> dict:
    """The policy options given on the command line (`--min-be-share`, `--token-group`,
    `--be-fills-rt-ends/--no-be-fills-rt-ends`, `--be-order`, `tandem bench ellm-sim`'s
    `--prefix-source` and `--layer-split`, `--aptserve-price-switches`)."""
    given = {k: getattr(args, FLAG_NAMES.get(k, k), None) for k in POLICY_FLAGS}
    return {k: v for k, v in given.items() if v is not None}


def policy_options(policy: str, cost_model=None, default_slo=None, flags: dict | None = None) -> dict:
    """The options a policy's constructor accepts among those we can offer (cost model, SLO,
    command-line flags such as BROS's minimum BE share); flags it does not take are ignored."""
    from engine.scheduling import policy_class

    accepted = inspect.signature(policy_class(policy).__init__).parameters
    offer = {"cost_model": cost_model, "default_slo": default_slo, **(flags or {})}
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
    if getattr(args, "source", None) is not None and policy == "ellm":  # ellm's prefix source
        cfg["uncached_source"] = args.source
    if getattr(args, "cost_model", None):  # the engine plans from it (and records it) instead of profiling
        cfg["cost_model_path"] = str(cost_model_file(args.cost_model))
    if getattr(args, "aptserve_price_switches", None) is not None and policy == "aptserve":
        cfg["aptserve_price_switches"] = args.aptserve_price_switches  # the engine profiles its cost model then
    return EngineConfig(**cfg)


def inproc_target(args: argparse.Namespace, policy: str, default_slo=None) -> TargetBundle:
    from loadgen.targets.inproc import InprocTarget
    from loadgen.workloads.random_tokens import special_token_ids

    cost = load_cost_model(args.cost_model) if getattr(args, "cost_model", None) else None
    opts = policy_options(policy, cost, default_slo, policy_flags(args))
    target = InprocTarget.from_config(engine_config(args, policy), opts)
    eng = target.engine
    mc = eng.model_config
    exclude = special_token_ids(eng.tokenizer, extra=[mc.bos_token_id, *mc.eos_token_ids])
    prompts = PromptBuilder(mc.vocab_size, args.seed, exclude, eng.tokenizer)
    return TargetBundle(target, prompts, eng.max_model_len, eng.tokenizer, policy_flags(args))


DEFAULT_STEP_NOISE = "lognormal:0.05"
DEFAULT_SWAP_SPACE_GIB = 4.0  # vLLM's default `swap_space` per GPU


def sim_target(args: argparse.Namespace, policy: str, default_slo=None) -> TargetBundle:
    """Simulated workers on the profile's truth (times the step noise); their policies plan
    with a model fitted to a noisy profile of that truth (`sim/planning.py`), and every policy
    gets the same host swap space. docs/simulator.md, "Fairness"."""
    from loadgen.sim.cluster import ClusterSpec, SimTarget
    from loadgen.sim.jitter import StepJitter
    from loadgen.sim.worker import SimWorker

    cost = load_cost_model(args.cost_model or DEFAULT_SIM_PROFILE)
    spec = worker_spec(args, cost.meta)
    mode = getattr(args, "session_mode", None)
    if mode == "recompute":  # vLLM without prefix caching: no history survives a turn
        spec = replace(spec, enable_prefix_caching=False)
    noise = StepJitter.parse(getattr(args, "step_noise", DEFAULT_STEP_NOISE), seed=args.seed)
    plan = cost if getattr(args, "exact_planning", False) else planning_cost(args, cost, spec, noise)
    opts = policy_options(policy, plan, default_slo, policy_flags(args))
    workers = [SimWorker(f"w{i}", spec, cost, policy, opts, jitter=noise, seed=args.seed) for i in range(args.workers)]
    bw = args.kv_bandwidth_gbps * 1e9 if args.kv_bandwidth_gbps else None
    disk = (getattr(args, "session_disk_gbps", None) or 0.0) * 1e9
    cluster = ClusterSpec(
        args.placement,
        bw,
        mode,
        getattr(args, "session_host_gib", 64.0),
        disk_bytes_per_s=disk,
        tally_from_s=getattr(args, "warmup_s", 0.0) or 0.0,
    )
    target = SimTarget(workers, cluster, planning_cost=plan)
    return TargetBundle(target, PromptBuilder(spec.vocab_size, args.seed), spec.max_model_len, None, policy_flags(args))


def planning_cost(args: argparse.Namespace, truth, spec, noise):
    from loadgen.sim.planning import planning_model

    return planning_model(
        truth,
        noise,
        seed=args.seed,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        max_model_len=spec.max_model_len,
        capacity_tokens=spec.num_blocks * spec.block_size,
        block_size=spec.block_size,
    )


def worker_spec(args: argparse.Namespace, meta: dict):
    from loadgen.sim.worker import WorkerSpec

    block = int(meta.get("block_size", 16))
    profile_bytes = int(meta.get("kv_bytes_per_token", 0))
    bytes_per_token = getattr(args, "kv_bytes_per_token", None) or profile_bytes
    # another KV size in the same device memory (e.g. Symphony's 1.1 MB/token): capacity scales
    capacity = int(meta["kv_capacity_tokens"]) * profile_bytes // bytes_per_token if "kv_capacity_tokens" in meta else 0
    num_blocks = args.num_blocks or (capacity // block + 1 if capacity else 4096)
    swap_gib = getattr(args, "swap_space_gib", DEFAULT_SWAP_SPACE_GIB)
    host_blocks = (
        int(swap_gib * 2**30) // (bytes_per_token * block) if bytes_per_token and swap_gib is not None else None
    )
    return WorkerSpec(
        num_blocks=num_blocks,
        block_size=block,
        max_num_seqs=args.max_num_seqs or 128,
        max_num_batched_tokens=args.max_num_batched_tokens or 2048,
        max_model_len=args.max_model_len or int(meta.get("max_model_len", 2048)),
        kv_bytes_per_token=bytes_per_token,
        host_blocks=host_blocks,
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
    rate = rate if rate is not None else args.rate
    arrival = ArrivalSpec(args.arrival, rate, args.cv, args.trace, args.users)
    # `--requests N`: a window of N expected arrivals at this rate (the papers' "N sampled requests")
    requests = getattr(args, "requests", None)
    return WorkloadConfig(
        name=args.workload,
        arrival=arrival,
        duration_s=requests / rate if requests else args.duration,
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
        users_ramp_s=getattr(args, "users_ramp_s", 0.0),
    )
