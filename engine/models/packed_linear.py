"""Linear layers with weights pre-packed for oneDNN (bfloat16 on CPU).

`F.linear` on CPU re-lays out (packs) the weight matrix into the GEMM kernel's blocked format
on every call. For the small row counts of a decode step that packing is a large share of
the matmul, and for the output head (vocab x hidden) it is most of it. oneDNN can pack once
at load time; `torch.ops.mkldnn._linear_pointwise` then runs the same GEMM on the packed
copy. These are the ops PyTorch's own CPU compiler (Inductor with weight freezing) emits, so
results are the same bf16 GEMM, only without the per-call repacking.

Used only where it applies: CPU, bfloat16 weights, a PyTorch built with oneDNN, and a CPU on
which oneDNN's bf16 reorder runs (probed at start, not assumed). Everywhere else (float32,
CUDA, an AVX2-only CPU) the model keeps its `nn.Linear` layers.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; any row count works. A decode batch is the
# case the packing is for (prefill chunks are large enough to amortise per-call packing).
_BATCH_HINT = 64


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear layers can be packed here: CPU, bfloat16, and oneDNN's packed bf16 GEMM
    actually runs on this CPU (probed once; see `_packed_bf16_gemm_works`)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
        and _packed_bf16_gemm_works()
    )


@functools.cache
def _packed_bf16_gemm_works() -> bool:
    """Run the packed bf16 GEMM once on a tiny matrix and compare it with float32 `F.linear`.

    oneDNN refuses its bf16 reorder on CPUs without AVX512-BW/VL/DQ or AVX-NE-CONVERT (AMD Zen 3,
    older Intel) and under `ONEDNN_MAX_CPU_ISA=AVX2`; there the layers stay `nn.Linear`, which
    computes bf16 by emulation. Logged either way, since it decides the speed of every GEMM.
    """
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as e:
        log.warning(
            "oneDNN packed bf16 GEMMs unavailable on this CPU (%s); linear layers stay unpacked "
            "(slower). dtype auto picks float32 on such CPUs.",
            str(e).splitlines()[0],
        )
        return False
    expected = F.linear(x.float(), w.float())
    if not torch.allclose(y.float(), expected, atol=0.05, rtol=0.02):
        log.warning("oneDNN packed bf16 GEMM gave wrong results in the start-up probe; linear layers stay unpacked")
        return False
    log.info("oneDNN packed bf16 GEMMs available")
    return True


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The packed GEMM as an op Inductor calls as is. Inductor's own lowering of
    `_linear_pointwise` assumes a weight frozen into the graph as a constant, and fails on
    a weight that is a graph input (as in a layer graph shared by every layer)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

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
