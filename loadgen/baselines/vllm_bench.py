"""vLLM baseline: the `tandem bench engine` workload on vLLM's offline `LLM` (CPU backend).

Runs under the vLLM virtualenv with the repository root on PYTHONPATH::

    PYTHONPATH=. .venv-vllm/bin/python loadgen/baselines/vllm_bench.py \
        --num-prompts 64 --input-len 50 300 --output-len 128 --dtype bfloat16 --seed 0 --json out.json

Model: vLLM 0.32 has no GGUF loader (the GGUF quantisation module was removed), so
``--model default`` means the dequantised Hugging Face export of the bundled SmolLM2-135M-Instruct
GGUF made by ``loadgen/baselines/export_hf.py`` (run under OUR venv; `make bench-vllm` does it).

vLLM settings are its defaults except what the workload dictates (dtype, greedy, ignore_eos,
max_tokens), the KV-cache size and, with `compare`, the batching limits and the CPU binding:

- KV cache: vLLM's CPU default reserves gpu_memory_utilization (0.92) of the NUMA node's memory
  and refuses to start when that much is not free, so it is always sized explicitly, in bytes
  (`kv_cache_memory_bytes`, the engine argument; VLLM_CPU_KVCACHE_SPACE would override it and
  only takes whole GiB, so it is removed from the environment when `--kv-cache-gib` is given).
  `compare` passes our engine's KV size; run alone the default is 4 GiB.
- `--max-num-seqs`, `--max-num-batched-tokens`: `compare` passes our engine's values.
- `--binding default`: vLLM's own (`VLLM_CPU_OMP_THREADS_BIND=auto`, which on x86 keeps one
  logical CPU per physical core of the first NUMA node and reserves one of them for the
  engine-core process: on a 2-core host, one core computes). `--binding all-cores`: OpenMP bound
  to one logical CPU per physical core of every core this process may use, none reserved (see
  `all_cores_bind_list`). Both are honest vLLM configurations; `compare` runs both and measures
  against the better one. Every VLLM_* variable in effect is recorded in the JSON.
Only the ``generate`` call over all prompts is timed, after a tiny warm-up generate, exactly as
`tandem bench engine` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadgen.bench.common import TreeRssSampler, add_workload_args, format_table, summarize, write_json  # noqa: E402
from loadgen.workloads.random_tokens import random_token_prompts, special_token_ids, warmup_prompt  # noqa: E402

BINDINGS = ("default", "all-cores")
DEFAULT_KV_CACHE_GIB = 4.0
# OpenMP placement inherited from the shell. vLLM sets these itself for its engine-core process
# (from VLLM_CPU_OMP_THREADS_BIND). Inherited, they pin this frontend process's main thread to
# one core as soon as torch starts OpenMP, the engine core inherits that one-CPU mask, and
# vLLM's auto binding then finds a single CPU (seen on the 2-core machine, whose environment
# sets OMP_PROC_BIND=close OMP_PLACES=cores): neither binding would be vLLM's.
INHERITED_OMP_PLACEMENT = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def drop_inherited_placement(environ: dict[str, str]) -> dict[str, str]:
    """Remove the inherited OpenMP placement variables from `environ`; returns what was removed."""
    return {k: environ.pop(k) for k in INHERITED_OMP_PLACEMENT if k in environ}


def all_cores_bind_list(cpus: list[tuple[int, tuple[str, str]]]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for every physical core: the lowest logical CPU of each core.

    `cpus`: (logical id, (package id, core id)) for each CPU this process may use. One OpenMP
    thread per physical core is what vLLM's own auto binding does on x86 (SMT siblings share
    the core's vector units); unlike it, no core is left out for the engine-core process and
    cores of every NUMA node count. Returns a comma-separated id list, e.g. "0,1".
    """
    first_of_core: dict[tuple[str, str], int] = {}
    for cpu, core in sorted(cpus):
        first_of_core.setdefault(core, cpu)
    if not first_of_core:
        raise ValueError("no CPUs to bind")
    return ",".join(str(c) for c in sorted(first_of_core.values()))


def allowed_cpu_topology() -> list[tuple[int, tuple[str, str]]]:
    """(logical id, (package, core)) of the CPUs this process may run on; each its own core when
    the topology is not readable (a container without /sys)."""
    out = []
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            core = ("?", str(cpu))
        out.append((cpu, core))
    return out


def binding_env(binding: str, cpus: list[tuple[int, tuple[str, str]]]) -> dict[str, str]:
    """The VLLM_CPU_* variables for `binding` ("default": none, vLLM decides)."""
    if binding == "default":
        return {}
    if binding == "all-cores":
        # An explicit list reserves nothing (VLLM_CPU_NUM_OF_RESERVED_CPU only trims the auto list).
        return {"VLLM_CPU_OMP_THREADS_BIND": all_cores_bind_list(cpus)}
    raise ValueError(f"binding must be one of {BINDINGS}, not {binding!r}")


def engine_core_binding() -> dict[str, list[int]]:
    """CPU affinity of each live child process (vLLM's engine core and its OpenMP threads):
    the binding vLLM actually applied, recorded with the result."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil ships with vLLM
        return {}
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cpus = sorted({c for t in child.threads() for c in psutil.Process(t.id).cpu_affinity()})
            out[f"{child.name()}[{child.pid}]"] = cpus
        except psutil.Error:
            pass
    return out


def llm_kwargs(
    model_path: str,
    *,
    dtype: str,
    seed: int,
    kv_cache_gib: float,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    log_stats: bool = True,
) -> dict:
    """The `vllm.LLM(...)` arguments for one run (pure; tested without vLLM)."""
    kw: dict = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=dtype,
        seed=seed,
        # disable_log_stats=False only so that RequestOutput.metrics (TTFT) is filled in.
        disable_log_stats=not log_stats,
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
    )
    if max_num_seqs is not None:
        kw["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    return kw


def resolve_model(model: str) -> str:
    if model != "default":
        return model
    from loadgen.baselines.export_hf import DEFAULT_EXPORT_DIR, is_exported

    if not is_exported(DEFAULT_EXPORT_DIR):
        raise SystemExit(
            f"no Hugging Face export at {DEFAULT_EXPORT_DIR}; run "
            "`.venv/bin/python -m loadgen.baselines.export_hf` first (under our venv)"
        )
    return str(DEFAULT_EXPORT_DIR)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM offline throughput on the tandem bench workload")
    add_workload_args(ap, dtype_choices=("bfloat16", "float32"))
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's own default")
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size in GiB, exact (kv_cache_memory_bytes; default: VLLM_CPU_KVCACHE_SPACE if set, else 4). "
        "Required here: vLLM's default (reserve gpu_memory_utilization=0.92 of the NUMA node) fails "
        "its start-up check on this machine",
    )
    ap.add_argument(
        "--binding",
        choices=BINDINGS,
        default="default",
        help="default: vLLM's own CPU binding (one core reserved); all-cores: OpenMP on every physical core",
    )
    ap.add_argument(
        "--prompts-file",
        default=None,
        help="JSON list of token-id lists to use instead of generating the random workload "
        "(compare.py passes the exact prompts our engine ran)",
    )
    ap.add_argument(
        "--no-log-stats",
        action="store_true",
        help="keep vLLM's offline default disable_log_stats=True (no per-request metrics, so no TTFT)",
    )
    ap.add_argument("--quiet", action="store_true", help="print only the JSON result")
    args = ap.parse_args(argv)

    if args.kv_cache_gib is not None:
        kv_gib = args.kv_cache_gib
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    else:
        kv_gib = float(os.environ.pop("VLLM_CPU_KVCACHE_SPACE", "") or DEFAULT_KV_CACHE_GIB)
    dropped_env = drop_inherited_placement(os.environ)
    os.environ.update(binding_env(args.binding, allowed_cpu_topology()))
    user_vllm_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_path = resolve_model(args.model)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = llm_kwargs(
        model_path,
        dtype=args.dtype,
        seed=args.seed,
        kv_cache_gib=kv_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        log_stats=not args.no_log_stats,
    )

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0

    tokenizer = llm.get_tokenizer()
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
    else:
        prompts = random_token_prompts(
            args.num_prompts,
            tuple(args.input_len),
            vocab_size,
            args.seed,
            exclude_ids=special_token_ids(tokenizer),
        )

    # Warm-up: one tiny request so lazy initialisation is not timed (same as our bench), on a prompt
    # outside the workload that seeds no prefix-cache entry it could hit (warmup_prompt).
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=warmup_prompt(prompts))], warm, use_tqdm=False)

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    with TreeRssSampler() as rss:
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start

    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    ttfts = []
    for o in outs:
        m = getattr(o, "metrics", None)
        lat = getattr(m, "first_token_latency", None) if m is not None else None
        if lat:
            ttfts.append(float(lat))

    vcfg = llm.llm_engine.vllm_config
    import torch
    import vllm

    resolved = {
        "max_num_seqs": vcfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": getattr(vcfg.scheduler_config, "enable_chunked_prefill", None),
        "block_size": vcfg.cache_config.block_size,
        "enable_prefix_caching": vcfg.cache_config.enable_prefix_caching,
        "kv_cache_memory_bytes": getattr(vcfg.cache_config, "kv_cache_memory_bytes", None),
        "num_gpu_blocks": getattr(vcfg.cache_config, "num_gpu_blocks", None),
        "max_model_len": vcfg.model_config.max_model_len,
        "dtype": str(vcfg.model_config.dtype),
        "compilation_mode": str(getattr(vcfg.compilation_config, "mode", None)),
    }
    config = {
        "model": args.model,
        "model_path": model_path,
        "num_prompts": len(prompts),
        "input_len": list(args.input_len),
        "output_len": args.output_len,
        "dtype": args.dtype,
        "seed": args.seed,
        "prompts_file": args.prompts_file,
        "vllm_args": {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")},
        "binding": args.binding,
        "vllm_resolved": resolved,
        "vllm_env": user_vllm_env,  # as given to vLLM (it sets a few more itself)
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    res = summarize(
        system=f"vllm-{args.binding}",
        num_requests=len(outs),
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        elapsed_s=elapsed,
        ttfts_s=ttfts,
        peak_rss_bytes=rss.peak_bytes,
        config=config,
        extra={"load_s": load_s, "ttft_source": "RequestOutput.metrics.first_token_latency" if ttfts else None},
        packages=("vllm",),
        provenance_extra={
            "vllm_binding": args.binding,
            "vllm_env": user_vllm_env,
            "dropped_openmp_placement": dropped_env,
            "engine_core_omp_binding": engine_core_binding(),
        },
    )
    if out_tokens != len(prompts) * args.output_len:
        print(f"warning: expected {len(prompts) * args.output_len} output tokens, got {out_tokens}", file=sys.stderr)
    write_json(res, args.json_path)
    if not args.quiet:
        print(format_table(res), file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
