"""Decode-only steps with each decoder layer compiled by Inductor into one graph.

Run op by op, a 64-sequence decode step of SmolLM2 on CPU is ~1,500 small PyTorch ops (norms,
RoPE, residual adds, activations, cache writes), each with its own dispatch and OpenMP region,
and every compiled attention call pays Dynamo's guard check. Compiled as one graph per layer,
Inductor fuses the elementwise work around the GEMMs into a few loops, and the attention
(`kernels/compiled/decode.py`) is traced into the same graph.

Decisions:
- *Per layer, not per model.* All layers share one graph: Dynamo inlines the layer module and
  takes its weights as inputs, so the graph compiles once (~7 s cold for SmolLM2) and is
  called once per layer. A single graph over all 30 layers ran ~10% faster but took 136 s
  to compile cold, too slow for an engine start.
- *A pure function of the cache.* The layer does not write its K/V; it attends the step's
  own token from its fresh k, v (`decode_attention_with_new`) and returns them, and the
  runner writes every layer's K/V in one copy after the last layer. Written inside the
  graph, the write would be a mutation of a graph input, which functionalization may turn
  into a copy of the whole cache.
- *Decode-only steps.* Prefill chunks (a step's few hundred to thousands of tokens) are
  dominated by GEMMs and keep the op-by-op path, as do steps that wait on KV loading per
  layer (session promotion) and rows without context.
- The weights' oneDNN GEMM is opaque to Inductor (`packed_linear.packed_linear`).
- One compiled copy per static configuration (model shape, dtype, block and chunk width),
  as for the attention kernel (`compile_copy`).
"""

from __future__ import annotations

import functools
import zlib

import torch
from torch import nn

from kernels import GRAPH_DECODE_KERNELS, DecodeBucket, decode_graph_context
from kernels.compiled.decode import chunk_blocks, compile_copy, warm_up_bucket


def supports_decode_graph(model: nn.Module) -> bool:
    """Models whose layers have `decode` and that give `layer_inputs` (the Llama family)."""
    return hasattr(model, "layer_inputs") and all(hasattr(layer, "decode") for layer in model.layers)


def _layer_decode(layer, x, layer_args, cache, context, scale: float, kernel: str):
    return layer.decode(x, *layer_args, cache, context, scale, kernel)


@functools.cache
def _compiled_layer(static: tuple):
    """Shared by every engine of the same model shape in a process: the weights are graph
    inputs, so a second engine reuses the graph instead of compiling its own."""
    return compile_copy(_layer_decode, "decode_layer", static)


class DecodeGraph:
    """Runs a decode-only step through compiled layers: returns the final hidden states and
    every layer's new K and V (`[layers, S, kv_heads, D]`) for the caller to write."""

    def __init__(self, model: nn.Module, scale: float, block_size: int, kernel: str = "fused") -> None:
        """`kernel`: the decode attention traced into the layers (`kernels.GRAPH_DECODE_KERNELS`)."""
        if kernel not in GRAPH_DECODE_KERNELS:
            raise ValueError(f"decode kernel {kernel!r} cannot run inside a compiled layer")
        self.model = model
        self.scale = scale
        self.block_size = block_size
        self.kernel = kernel
        shape = zlib.crc32(repr(model.config).encode())  # stable across processes, for Inductor's disk cache
        dtype = next(model.parameters()).dtype
        static = (type(model).__name__, shape, dtype, block_size, chunk_blocks(block_size), kernel)
        self._layer = _compiled_layer(static)

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], context: DecodeBucket
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`context`: a bucket of every row with its context *before* this step (lengths >= 1)."""
        seqs = input_ids.shape[0]
        if seqs == 1:  # Dynamo specialises size 1: the same sequence twice, the copy dropped
            input_ids, positions = input_ids.expand(2), positions.expand(2)
        x, *layer_args = self.model.layer_inputs(input_ids, positions)
        layer_args = tuple(layer_args)
        step_context = decode_graph_context(self.kernel, context, x.shape[0])
        for t in (x, *layer_args):
            torch._dynamo.mark_dynamic(t, 0)
        keys, values = [], []
        for layer, cache in zip(self.model.layers, caches):
            torch._dynamo.mark_dynamic(cache, 2)
            x, k, v = self._layer(layer, x, layer_args, cache, step_context, self.scale, self.kernel)
            keys.append(k)
            values.append(v)
        return x[:seqs], torch.stack(keys)[:, :seqs], torch.stack(values)[:, :seqs]

    @torch.inference_mode()
    def warm_up(self, caches: list[torch.Tensor]) -> None:
        """Compile now, on two dummy sequences over the null block (nothing is written).

        The dummy bucket is built in inference mode, as the runner builds a step's: Dynamo
        guards on each input tensor's dispatch keys, and a block table made outside it (a
        normal tensor, where a step's is an inference tensor) made the first decode-only step
        of every engine recompile the layer graph (~1-8 s, mid-serving; the C++ kernel's
        context passes the table through as it is)."""
        bucket = warm_up_bucket(self.block_size, caches[0].device)
        ids = torch.zeros(2, dtype=torch.long, device=caches[0].device)
        self(ids, ids, caches, bucket)
