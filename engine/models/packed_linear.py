"""Linear layers with weights pre-packed for oneDNN (CPU, bfloat16 and float32).

`F.linear` on CPU re-lays out (packs) the weight matrix into the GEMM kernel's blocked format
on every call. For the small row counts of a decode step that packing is a large share of
the matmul, and for the output head (vocab x hidden) it is most of it. oneDNN can pack once
at load time; `torch.ops.mkldnn._linear_pointwise` then runs the same GEMM on the packed
copy. These are the ops PyTorch's own CPU compiler (Inductor with weight freezing) emits, so
results are the same GEMM, only without the per-call repacking.

Which GEMM runs each dtype is probed at start, never assumed (`packing_pays`):
- bfloat16: oneDNN packed wherever its packed bf16 GEMM runs (it refuses CPUs without
  AVX512-BW/VL/DQ or AVX-NE-CONVERT, and `ONEDNN_MAX_CPU_ISA=AVX2`); elsewhere `nn.Linear`.
- float32: `F.linear` is MKL's sgemm in PyTorch's x86 builds, and MKL runs its AVX2 code on
  AMD CPUs, while oneDNN uses AVX-512 there: on the Zen 5 development machine (one thread,
  SmolLM2's shapes) MKL did ~100 GFLOP/s and packed oneDNN ~250 (~130 under the AVX2
  emulation variables). On an Intel CPU MKL may be the faster one. So both are timed on the
  model's own largest layer at start (a few calls each on one thread, by CPU time, ~0.1 s)
  and oneDNN is used only if it is clearly faster. MKL's own packed sgemm
  (`torch.ops.mkl._mkl_linear`) is no candidate: it uses the packed weight only for the
  exact row count it was packed for.
Everywhere else (CUDA, float16) the model keeps its `nn.Linear` layers.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; any row count works. A decode batch is the
# case the packing is for (prefill chunks are large enough to amortise per-call packing).
_BATCH_HINT = 64
_PROBE_ROWS = (64, 256)  # row counts the float32 probe times (decode batch, prefill chunk)
_PROBE_CALLS = 5  # timed calls per candidate and row count (the fastest counts)
_MIN_GAIN = 0.9  # pack float32 only if oneDNN takes at most this fraction of F.linear's time
_TOLERANCE = {torch.bfloat16: (0.05, 0.02), torch.float32: (1e-4, 1e-4)}


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear layers can be packed here: CPU, bfloat16 or float32, and oneDNN's packed
    GEMM actually runs (and is right) on this CPU for that dtype (probed once)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        device.type == "cpu"
        and dtype in _TOLERANCE
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
        and _packed_gemm_works(dtype)
    )


def packing_pays(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether to pack `model`'s linear layers: where supported, always for bfloat16; for
    float32 only if packed oneDNN beats `F.linear` on the model's largest layer (logged)."""
    if not packing_supported(dtype, device):
        return False
    if dtype != torch.float32:
        return True
    weight = _largest_weight(model)
    if weight is None:
        return False
    packed_s, plain_s = _time_packed_vs_plain(weight)
    pays = packed_s <= _MIN_GAIN * plain_s
    log.info(
        "float32 GEMMs: oneDNN packed %.2f ms vs F.linear %.2f ms on a %dx%d layer -> %s",
        packed_s * 1e3,
        plain_s * 1e3,
        *weight.shape,
        "packed oneDNN" if pays else "F.linear",
    )
    return pays


def _largest_weight(model: nn.Module) -> torch.Tensor | None:
    """The biggest `nn.Linear` weight other than the output head (the per-layer GEMMs decide)."""
    layers = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    return max((m.weight for m in layers), key=lambda w: w.numel(), default=None)


def _time_packed_vs_plain(weight: torch.Tensor) -> tuple[float, float]:
    """CPU seconds per call summed over the probe row counts, fastest of a few calls each.

    Timed on one thread with the thread's own CPU clock, and with the two candidates' calls
    alternating: the machine may be shared, and wall-clock time under other processes' load
    (seen: 30-50x slower calls in bursts) would decide the choice at random."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, weight.shape[1], generator=gen, dtype=weight.dtype) for rows in _PROBE_ROWS]
    candidates = (lambda x: _onednn_linear(x, packed, None), lambda x: F.linear(x, weight))
    packed_s = plain_s = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for x in inputs:
                best = [float("inf"), float("inf")]
                for call in candidates:
                    call(x)  # first call: allocation, oneDNN primitive creation
                for _ in range(_PROBE_CALLS):
                    for i, call in enumerate(candidates):
                        start = time.thread_time()
                        call(x)
                        best[i] = min(best[i], time.thread_time() - start)
                packed_s, plain_s = packed_s + best[0], plain_s + best[1]
    finally:
        torch.set_num_threads(threads)
    return packed_s, plain_s


@functools.cache
def _packed_gemm_works(dtype: torch.dtype) -> bool:
    """Run the packed GEMM once on a tiny matrix and compare it with float32 `F.linear`.

    oneDNN refuses its bf16 reorder on CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT (AMD Zen 3,
    older Intel) and under `ONEDNN_MAX_CPU_ISA=AVX2`; there the layers stay `nn.Linear`, which
    computes bf16 by emulation. Logged either way, since it decides the speed of every GEMM.
    """
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen).to(dtype)
    x = torch.randn(4, 64, generator=gen).to(dtype)
    name = str(dtype).removeprefix("torch.")
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as e:
        log.warning(
            "oneDNN packed %s GEMMs unavailable on this CPU (%s); linear layers stay unpacked%s",
            name,
            str(e).splitlines()[0],
            " (slower). dtype auto picks float32 on such CPUs." if dtype == torch.bfloat16 else "",
        )
        return False
    atol, rtol = _TOLERANCE[dtype]
    if not torch.allclose(y.float(), F.linear(x.float(), w.float()), atol=atol, rtol=rtol):
        log.warning("oneDNN packed %s GEMM gave wrong results in the start-up probe; linear layers stay unpacked", name)
        return False
    log.info("oneDNN packed %s GEMMs available", name)
    return True


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The packed GEMM as an op Inductor calls as is. Inductor's own lowering of
    `_linear_pointwise` assumes a weight frozen into the graph as a constant, and fails on
    a weight that is a graph input (as in a layer graph shared by every layer)."""
    return _onednn_linear(x, packed, bias)


@packed_linear.register_fake
def _packed_linear_shape(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with `weight` held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT), persistent=False
        )
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inside a compiled decoder layer (models/decode_graph.py)
            return packed_linear(x, self.packed, self.bias, self.out_features)
        return _onednn_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `PackedLinear` (after the weights are loaded).

    A tied output head (`lm_head is None`, logits from the embedding matrix) gets its own
    packed copy of the embedding; the embedding itself stays for token lookup. Returns the
    number of layers packed.
    """
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                count += 1
    if getattr(model, "lm_head", False) is None:
        model.lm_head = PackedLinear(model.embed_tokens.weight, None)
        count += 1
    return count
