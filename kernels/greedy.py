"""Greedy token selection (the index of each logits row's maximum) behind one choice.

`torch.argmax` over a decode step's logits is not vectorised on CPU (1.66 ms of one core for
[64, 49152] float32 against 0.12 ms for `amax`, issue 15's step profile), so on a CPU the
C++ op `argmax_rows` (`kernels/cpu/argmax.cpp`, built with the other CPU kernels for this
CPU's ISA) does it; `torch.argmax(x, dim=1)` is its oracle and the path everywhere else.
The tie rule is torch's: the lowest index wins, and a row with a NaN gives its first NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ARGMAX_CHOICES = ("auto", "cpp", "torch")
Argmax = Callable[[torch.Tensor], torch.Tensor]  # [N, V] -> int64 [N]


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=1)


class CppArgmax:
    """The C++ op for float32/bfloat16 CPU rows; anything else goes to torch (same answer).
    `target` picks a build target other than this CPU's (tests)."""

    name = "cpp"

    def __init__(self, target: str | None = None) -> None:
        from kernels.cpu import decode

        self._ns = decode.ops(target)  # builds or loads now: raises KernelBuildError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.shape[1] == 0:
            return torch_argmax(x)
        if x.stride(1) != 1:
            x = x.contiguous()
        return self._ns.argmax_rows(x)


def choose_argmax(setting: str, device: torch.device | str) -> Argmax:
    """The greedy argmax an engine uses, decided once at start and logged.

    `auto`: the C++ op on a CPU where the probe finds a build target and the library loads
    (else torch, with a warning when the build failed); `cpp`: the C++ op or an error;
    `torch`: `torch.argmax`."""
    if setting not in ARGMAX_CHOICES:
        raise ValueError(f"greedy_kernel must be one of {', '.join(ARGMAX_CHOICES)}, not {setting!r}")
    if setting == "torch":
        log.info("greedy argmax: torch.argmax")
        return torch_argmax
    from kernels.cpu.choice import CppChoice, cpp_or_fallback

    why = f"device {device} is not a CPU" if torch.device(device).type != "cpu" else None
    choice = CppChoice("greedy_kernel", "greedy argmax", "C++ op", "torch.argmax")
    return cpp_or_fallback(choice, setting, why, CppArgmax, torch_argmax, log)
