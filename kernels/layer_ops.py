"""The elementwise work of a decoder layer behind one interface: fused C++ kernels or PyTorch.

A Llama layer's GEMMs are surrounded by RMSNorm, residual adds, Qwen3's q/k norms, RoPE,
SiLU * up and the paged KV write. Run op by op they are ~40% of a float32 prefill step on CPU
(docs/engine.md, "Where a CPU decode step goes"); `CppLayerOps` does each in one pass
(`kernels/cpu/elementwise.cpp`), `TorchLayerOps` is the plain-PyTorch oracle
(`kernels/reference/elementwise.py`) and the path on GPUs, in float16 and where no C++
compiler exists. The model holds one of them, chosen once at engine start
(`choose_layer_ops`, `EngineConfig.fused_ops`), and passes it to its layers explicitly.

Decisions:
- *In place where the model no longer needs the input.* The C++ add + RMSNorm writes the new
  residual over the old one, RoPE rotates q and k inside the QKV projection's output; the
  PyTorch versions return new tensors. Callers always use the returned tensors, so both
  behave the same to them.
- *RoPE reads the whole cos/sin tables at the step's positions* (`rope_tables`) instead of a
  per-step gather of [T, 1, D] tables: one fewer copy per step and no broadcast.
- *Compiled decode layers keep PyTorch ops* (`engine/models/decode_graph.py`): Inductor
  fuses them into its own loops around the GEMMs, which an opaque custom op would prevent.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from kernels.attention import write_kv_cache, write_kv_cache_layers
from kernels.reference import elementwise as _ref

log = logging.getLogger(__name__)

FUSED_OPS_CHOICES = ("auto", "cpp", "off")


class LayerOps(ABC):
    """The elementwise ops a decoder layer uses. Every method returns what the caller must use
    from then on; an implementation may have written it into an input."""

    name: str

    @abstractmethod
    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple:
        """What `qk_norm_rope` needs for this step, from the full [max_pos, D] tables (in the
        model's dtype) and the step's positions [T]; built once per step, shared by all layers."""

    @abstractmethod
    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + delta) * weight, residual + delta); `delta` None: no add."""

    @abstractmethod
    def qk_norm_rope(
        self,
        qk: torch.Tensor,
        tables: tuple,
        q_heads: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """qk [T, q_heads + k_heads, D] after the optional per-head q/k RMSNorm and RoPE."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of a [T, 2I] gate/up projection."""

    @abstractmethod
    def write_kv_layers(self, kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [L, T, KVH, D] into kv_data [L, 2, KVH, NB, BS, D] at the flat slots [T]."""

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """One layer: k, v [T, KVH, D] into its cache [2, KVH, NB, BS, D]."""
        self.write_kv_layers(kv_cache.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), slots)


class TorchLayerOps(LayerOps):
    """Plain PyTorch, op by op (the oracle); the KV write goes through `kernels.attention`'s
    device dispatch (Triton on CUDA)."""

    name = "torch"

    def rope_tables(self, cos, sin, positions):
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def add_rms_norm(self, residual, delta, weight, eps):
        return _ref.add_rms_norm(residual, delta, weight, eps)

    def qk_norm_rope(self, qk, tables, q_heads, q_norm, k_norm, eps):
        return _ref.qk_norm_rope(qk, *tables, q_heads, q_norm, k_norm, eps)

    def silu_mul(self, gate_up):
        return _ref.silu_mul(gate_up)

    def write_kv_layers(self, kv_data, k, v, slots):
        write_kv_cache_layers(kv_data, k, v, slots)

    def write_kv(self, kv_cache, k, v, slots):
        write_kv_cache(kv_cache, k, v, slots)


class CppLayerOps(LayerOps):
    """The fused C++ kernels built for this CPU's ISA (`kernels/cpu/`); float32 and bfloat16 on
    CPU. `target` picks a build target other than this CPU's (tests)."""

    name = "cpp"

    def __init__(self, target: str | None = None) -> None:
        from kernels.cpu import elementwise

        self._cpu = elementwise
        self._ns = elementwise.ops(target)  # builds or loads now: raises KernelBuildError

    def rope_tables(self, cos, sin, positions):
        return positions.to(torch.long).contiguous(), cos, sin

    def add_rms_norm(self, residual, delta, weight, eps):
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        return self._cpu.add_rms_norm(residual, delta, weight, eps, self._ns)

    def qk_norm_rope(self, qk, tables, q_heads, q_norm, k_norm, eps):
        positions, cos, sin = tables
        return self._cpu.qk_norm_rope(qk, positions, cos, sin, q_heads, q_norm, k_norm, eps, self._ns)

    def silu_mul(self, gate_up):
        return self._cpu.silu_mul(gate_up, self._ns)

    def write_kv_layers(self, kv_data, k, v, slots):
        self._cpu.write_kv(kv_data, k, v, slots.to(torch.long).contiguous(), self._ns)


TORCH_LAYER_OPS = TorchLayerOps()


def choose_layer_ops(setting: str, device: torch.device | str, dtype: torch.dtype) -> LayerOps:
    """The layer ops an engine uses, decided once at start and logged.

    `auto`: the C++ kernels on a CPU in float32 or bfloat16 where the probe finds a build
    target and the library builds and loads (else PyTorch, with a warning when the build
    failed); `cpp`: the C++ kernels or an error; `off`: PyTorch.
    """
    if setting not in FUSED_OPS_CHOICES:
        raise ValueError(f"fused_ops must be one of {', '.join(FUSED_OPS_CHOICES)}, not {setting!r}")
    if setting == "off":
        log.info("fused layer ops: off (PyTorch op by op)")
        return TORCH_LAYER_OPS
    from kernels.cpu.choice import CppChoice, cpp_or_fallback

    why = None
    if torch.device(device).type != "cpu":
        why = f"device {device} is not a CPU"
    elif dtype not in (torch.float32, torch.bfloat16):
        why = f"dtype {dtype} (the kernels do float32 and bfloat16)"
    choice = CppChoice("fused_ops", "fused layer ops", "C++ kernels", "PyTorch op by op")
    return cpp_or_fallback(choice, setting, why, CppLayerOps, TORCH_LAYER_OPS, log)
