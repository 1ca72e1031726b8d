"""Architecture name -> model class."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.opt import OPTForCausalLM
from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps

_MODELS: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "opt": OPTForCausalLM}


def build_model(
    config: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: str | torch.device,
    ops: LayerOps = TORCH_LAYER_OPS,
) -> nn.Module:
    """An empty model of the right class, in `dtype` on `device`, ready for `load_weights`;
    `ops`: its layers' elementwise ops (`kernels.layer_ops.choose_layer_ops`)."""
    try:
        cls = _MODELS[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: {sorted(_MODELS)}") from None
    with torch.device("meta"):
        model = cls(config, max_positions, ops)
    model = model.to_empty(device=device)
    _reinit_buffers(model, config, max_positions)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def _reinit_buffers(model: nn.Module, config: ModelConfig, max_positions: int) -> None:
    """Meta-device init leaves buffers empty; rebuild the ones computed at construction."""
    rotary = getattr(model, "rotary", None)
    if rotary is not None:
        fresh = type(rotary)(config, max_positions)
        rotary.cos, rotary.sin = fresh.cos.to(rotary.cos.device), fresh.sin.to(rotary.sin.device)
