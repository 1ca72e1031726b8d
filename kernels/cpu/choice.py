"""One rule for every "C++ op or PyTorch" setting (`auto` / `cpp` / a PyTorch value): take the
C++ op where this CPU has a build target and it builds and loads, else PyTorch with the reason
logged (a warning when a build failed); an explicit `cpp` that cannot run is an error at start,
never a silent fallback. `kernels/greedy.py` and `kernels/layer_ops.py` decide through it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kernels.cpu import build

T = TypeVar("T")


@dataclass(frozen=True)
class CppChoice:
    """How one such setting is named: `option` in errors ("greedy_kernel"), `label` in the log
    ("greedy argmax"), and its two paths ("C++ op", "torch.argmax")."""

    option: str
    label: str
    cpp_name: str
    fallback_name: str


def cpp_or_fallback(
    choice: CppChoice,
    setting: str,
    why_not: str | None,
    make_cpp: Callable[[], T],
    fallback: T,
    log: logging.Logger,
) -> T:
    """`make_cpp()` unless `why_not` (a reason this device/dtype cannot take the C++ op), this
    CPU has no build target, or the build fails; `setting` is the user's value; the decision is
    logged on the caller's `log`."""
    if why_not is None and build.target_for() is None:
        why_not = "no C++ kernel target for this CPU"
    if why_not is None:
        try:
            op = make_cpp()
        except build.KernelBuildError as exc:
            if setting == "cpp":
                raise
            log.warning(
                "C++ %s unavailable (%s); using %s", choice.label, str(exc).splitlines()[0], choice.fallback_name
            )
            return fallback
        log.info("%s: %s, target %s", choice.label, choice.cpp_name, build.target_for())
        return op
    if setting == "cpp":
        raise ValueError(f"{choice.option}='cpp' cannot run here: {why_not}")
    log.info("%s: %s (%s)", choice.label, choice.fallback_name, why_not)
    return fallback
