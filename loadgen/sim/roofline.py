"""Cost-model profiles for GPUs we do not have, derived from roofline numbers.

For each phase we evaluate a roofline step time over the same powers-of-two grid the
profiler measures (batch sizes x context lengths), then fit the profiler's model
``alpha0*L^n + alpha1*sum(n_i*a_i) + beta`` to those points with `cost_model.fit`:

    t(step) = overhead + max(FLOPs / (peak * mfu), bytes / (bandwidth * mbu))

- FLOPs: ``2 * params`` per new token (the linear layers) plus attention, ``4 * layers *
  heads * head_dim`` per (query token, context token) pair, halved for a causal prefill.
- bytes: the weights once per step, plus K and V of every context token of every decode row
  (``kv_bytes_per_token``), plus the new tokens' K/V writes.
- the hybrid cache's rebuild (`hidden_s_per_token`, docs/aptserve.md), per HIDDEN context
  token per step, as Apt-Serve's code runs it: a gather of the stored row into a dense buffer,
  the K/V projection (``2 * layers * hidden * 2*kv_heads*head_dim`` FLOPs) in *one GEMM with
  the step's own new tokens*, and a scatter of the rebuilt K/V into a scratch cache. That GEMM
  streams W_k and W_v anyway, so it is memory-bound up to its roofline knee, where a row's
  FLOPs time catches up with the weights' time plus the rows' own bytes (about
  ``dtype_bytes * peak*mfu / (2 * bandwidth*mbu)`` rows: 130 for OPT-13B on the A100), and a
  rebuilt row below the knee costs only its bytes (the row in and its K/V out
  of the GEMM, plus the gather and the scatter: ``hidden_free_s_per_token``); past the knee it
  costs the GEMM's FLOPs plus the gather and scatter bytes (``hidden_s_per_token``). The step's
  new tokens fill the knee first (`CostModel.hidden_seconds`). Why not "free under the whole
  decode step's memory time": the K/V GEMM is 1/6 of a layer's weights (OPT: 2d^2 of 12d^2) and
  a kernel cannot lend its idle compute to the next one, so only that GEMM's own weight time
  hides rows. The gather and scatter are separate memory-bound kernels and are added. For
  OPT-13B on the A100: 28.9 us per token past the knee (rho about 0.46 ms per 16-token block),
  3.0 us below it. The attention over the rebuilt K/V is a decode row's like any other
  (``alpha1``).
- mfu/mbu: the fraction of peak compute / memory bandwidth achieved (0.5 and 0.8 by default,
  typical of vLLM-era kernels), and a fixed per-step overhead (scheduling, sampling, launch).

Run ``python -m loadgen.sim.roofline --out loadgen/sim/profiles`` to regenerate the shipped
files; a profile measured with `tandem profile` on the real GPU replaces them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from engine.cost_model import CostModel, Sample, fit, mape


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense fp16/bf16 tensor FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float  # device memory in bytes: a "40 GB" part has 40 GiB (40 * 2**30)
    host_link_bytes_per_s: float  # effective PCIe bandwidth for swaps


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    max_model_len: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_width(self) -> int:
        """K+V values per token per layer."""
        return 2 * self.kv_heads * self.head_dim


GIB = 2**30

# Memory sizes are binary: an "A100 40GB" has 40 GiB of HBM (vLLM sizes KV from
# torch.cuda.mem_get_info, in bytes), so 40e9 would undercount its KV space by 7%, and by
# 24% once the 25.7 GB of OPT-13B weights are taken off. Bandwidths and FLOP/s are decimal.
GPUS = {
    # A100-SXM4-40GB: 312 TFLOP/s fp16 dense, 1,555 GB/s HBM2; PCIe 4.0 x16 ~25 GB/s effective
    "a100-40gb": GPU("A100-SXM4-40GB", 312e12, 1.555e12, 40 * GIB, 25e9),
    # H100-SXM5-80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3; PCIe 5.0 x16 ~50 GB/s effective
    "h100": GPU("H100-SXM5-80GB", 989e12, 3.35e12, 80 * GIB, 50e9),
    # A100-PCIE-80GB (eLLM's testbed, PCIe 4.0 x16, no NVLink): 312 TFLOP/s fp16 dense,
    # 1,935 GB/s HBM2e (NVIDIA's datasheet); ~25 GB/s effective host link
    "a100-80gb": GPU("A100-PCIE-80GB", 312e12, 1.935e12, 80 * GIB, 25e9),
}
MODELS = {
    "opt-13b": Model("facebook/opt-13b", 12.85e9, 40, 5120, 40, 40, 128, 2048),
    "llama-3-8b": Model("meta-llama/Meta-Llama-3-8B", 8.03e9, 32, 4096, 32, 8, 128, 8192),
    # Symphony's own model: Llama-3-8B's weights and shape with a 128K context, so histories can
    # grow past 8K (issue 20: 8x needs ~15K-token prompts, docs/sessions.md)
    "llama-3.1-8b": Model("meta-llama/Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128, 131072),
    # eLLM's single-GPU model (MHA, native 4K context)
    "llama-2-13b": Model("meta-llama/Llama-2-13b-hf", 13.02e9, 40, 5120, 40, 40, 128, 4096),
}


@dataclass(frozen=True)
class Efficiency:
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 0.003
    gpu_memory_utilization: float = 0.9  # vLLM's default share of memory for weights + KV
    activation_reserve_bytes: float = 2 * GIB


def step_time(m: Model, g: GPU, e: Efficiency, rows: list[tuple[int, int]], decode: bool) -> float:
    flops = bytes_ = 0.0
    attn = 4 * m.layers * m.heads * m.head_dim
    for n, a in rows:
        flops += 2 * m.params * n + attn * n * (a if decode else a / 2)
        bytes_ += (a if decode else 0) * m.kv_bytes_per_token + n * m.kv_bytes_per_token
    bytes_ += m.weight_bytes
    return e.overhead_s + max(flops / (g.peak_flops * e.mfu), bytes_ / (g.hbm_bytes_per_s * e.mbu))


@dataclass(frozen=True)
class Rebuild:
    """The hybrid cache's rebuild prices (module docstring)."""

    s_per_token: float  # past the K/V GEMM's knee: its FLOPs plus the gather/scatter bytes
    free_rows: float  # the knee: rows the GEMM's weight streaming hides
    free_s_per_token: float  # below the knee: the row's bytes only


def rebuild_prices(m: Model, g: GPU, e: Efficiency) -> Rebuild:
    """Per HIDDEN context token per step, over all layers (module docstring)."""
    bw, peak = g.hbm_bytes_per_s * e.mbu, g.peak_flops * e.mfu
    gemm_flops = 2 * m.layers * m.hidden * m.kv_width
    gather_scatter = m.layers * m.dtype_bytes * (2 * m.hidden + 2 * m.kv_width)  # x in/out, K/V in/out
    gemm_io = m.layers * m.dtype_bytes * (m.hidden + m.kv_width)  # the row into the GEMM, its K/V out
    # the knee: where a row's FLOPs time catches up with the weights' time plus the rows' own bytes
    weights = m.layers * m.dtype_bytes * m.hidden * m.kv_width
    knee = (weights / bw) / (gemm_flops / peak - gemm_io / bw)
    return Rebuild(gemm_flops / peak + gather_scatter / bw, knee, (gather_scatter + gemm_io) / bw)


def hidden_s_per_token(m: Model, g: GPU, e: Efficiency) -> float:
    """Seconds one HIDDEN context token's K/V rebuild adds to a step past the knee."""
    return rebuild_prices(m, g, e).s_per_token


def grid_samples(
    m: Model, g: GPU, e: Efficiency, decode: bool, max_batch: int = 256, max_tokens: int = 8192
) -> list[Sample]:
    out = []
    for batch in _pow2(1, max_batch):
        for ctx in _pow2(16, m.max_model_len):
            n = 1 if decode else ctx
            if batch * n > max_tokens or (decode and batch * ctx > 4 * max_batch * m.max_model_len):
                continue
            rows = [(n, ctx)] * batch
            out.append(Sample(batch * n, batch * n * ctx, step_time(m, g, e, rows, decode)))
    return out


def _pow2(lo: int, hi: int) -> list[int]:
    v, out = lo, []
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def kv_capacity_tokens(m: Model, g: GPU, e: Efficiency, tp: int = 1) -> int:
    free = g.memory_bytes * tp * e.gpu_memory_utilization - m.weight_bytes - e.activation_reserve_bytes * tp
    return max(0, int(free // m.kv_bytes_per_token))


def build_profile(model: str, gpu: str, e: Efficiency = Efficiency()) -> CostModel:
    m, g = MODELS[model], GPUS[gpu]
    pre, dec = grid_samples(m, g, e, decode=False), grid_samples(m, g, e, decode=True)
    pfit, dfit = fit(pre), fit(dec)
    meta = {
        "model": m.name,
        "device": g.name,
        "dtype": "float16",
        "source": "roofline (loadgen/sim/roofline.py)",
        "swap_overlaps": True,
        "mfu": e.mfu,
        "mbu": e.mbu,
        "overhead_s": e.overhead_s,
        "prefill_mape": mape(pfit, pre),
        "decode_mape": mape(dfit, dec),
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "kv_capacity_tokens": kv_capacity_tokens(m, g, e),
        "max_model_len": m.max_model_len,
        "block_size": 16,
        # the model's shape, for the simulator's hybrid cache (HIDDEN rows and their memory)
        "hidden_size": m.hidden,
        "head_dim": m.head_dim,
        "num_kv_heads": m.kv_heads,
    }
    rebuild = rebuild_prices(m, g, e)
    return CostModel(
        pfit, dfit, g.host_link_bytes_per_s, meta, rebuild.s_per_token, rebuild.free_rows, rebuild.free_s_per_token
    )


SHIPPED = {
    "opt-13b-a100-40gb": ("opt-13b", "a100-40gb"),
    "llama-3-8b-h100": ("llama-3-8b", "h100"),
    "llama-2-13b-a100-80gb": ("llama-2-13b", "a100-80gb"),  # eLLM's setup (issue 18)
    # Symphony's GPU (8 A100-80GB) for its Llama-3.1-8B: its ratio turns on the GPU's FLOP/byte
    # balance (docs/sessions.md, "What stops hints at ~2x"); the paper does not say PCIe or SXM
    "llama-3-8b-a100-80gb": ("llama-3-8b", "a100-80gb"),
    "llama-3.1-8b-a100-80gb": ("llama-3.1-8b", "a100-80gb"),  # its 128K context (long histories)
}


def link_scaled(name: str, scale: float, attention_flops_only: bool = False) -> CostModel:
    """The shipped profile `name` with its host link `scale` times as fast (eLLM's host-link
    sweep, docs/ellm.md), stamped with the code and host that made it (`meta.provenance`): an
    input for the simulator, not a measurement.

    `attention_flops_only`: decode attention priced as the paper's Eq. 3 prices it, by its
    FLOPs (`4·layers·heads·head_dim` per context token at the GPU's effective FLOPS) instead of
    the roofline's read of each context token's K/V from HBM (the decode fit's `alpha1`): the
    assumption under which freeing memory raises throughput as the paper reports
    (docs/ellm.md, "Eighth session")."""
    from loadgen.provenance import stamp

    model, gpu = SHIPPED[name]
    cm = build_profile(model, gpu)
    meta = dict(cm.meta)
    what = f"swap_bytes_per_s x{scale:g}" + (", decode attention by FLOPs only" if attention_flops_only else "")
    meta["source"] = f"{name} (loadgen/sim/profiles) with {what}: an input for docs/ellm.md's sweeps, not a measurement"
    flag = " --attention-flops-only" if attention_flops_only else ""
    meta["command"] = f"python -m loadgen.sim.roofline --link-scale {scale:g}{flag} --profile {name} --file FILE"
    meta["provenance"] = stamp().as_dict()
    decode = cm.decode
    if attention_flops_only:
        m, g, e = MODELS[model], GPUS[gpu], Efficiency()
        decode = replace(decode, alpha1=4 * m.layers * m.heads * m.head_dim / (g.peak_flops * e.mfu))
    return replace(cm, decode=decode, swap_bytes_per_s=cm.swap_bytes_per_s * scale, meta=meta)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write the roofline-derived cost-model profiles")
    ap.add_argument("--out", default=str(Path(__file__).parent / "profiles"))
    ap.add_argument("--link-scale", type=float, default=None, help="write one profile with its host link scaled")
    ap.add_argument("--profile", default="llama-2-13b-a100-80gb", choices=sorted(SHIPPED), help="with --link-scale")
    ap.add_argument("--file", default=None, help="with --link-scale: where to write it")
    ap.add_argument(
        "--attention-flops-only", action="store_true", help="with --link-scale: price decode attention by FLOPs only"
    )
    args = ap.parse_args(argv)
    if args.link_scale is not None:
        if not args.file:
            ap.error("--link-scale needs --file")
        link_scaled(args.profile, args.link_scale, args.attention_flops_only).save(args.file)
        return 0
    for name, (model, gpu) in SHIPPED.items():
        cm = build_profile(model, gpu)
        cm.save(Path(args.out) / f"{name}.json")
        print(
            f"{name}: prefill {cm.prefill}, decode {cm.decode}, MAPE {cm.meta['prefill_mape']:.1%}/"
            f"{cm.meta['decode_mape']:.1%}, KV {cm.meta['kv_capacity_tokens']} tokens"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
