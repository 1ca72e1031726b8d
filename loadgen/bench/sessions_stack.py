"""What each `tandem bench sessions` mode's stack runs with: the modes and the stack settings.

A mode is what the client sends (session ids, typing hints) plus the settings that make the
stack that mode (routing, prefix cache). Beside them, three bench options shape every mode's
stack alike (docs/sessions.md, "Making the hint measurable"):

- `--stack-env KEY=VALUE`: any stack setting, e.g. `TANDEM_HOLDER_SLACK=1` so a turn leaves a
  busy holder sooner. A key a mode defines (routing, prefix cache) is refused: it would change
  what the mode stands for.
- `--scale-hint-timers`: the stack's human-time constants on the hint path divided by
  `--speedup`, as the people are: the placement TTL (30 s past the expected arrival), its cap
  (300 s), the gateway's typing debounce (2 s), the arrival assumed for a hint that names none
  (60 s) and a placement's life after its turn arrives (2 s). At 50x a turn follows the last one ~1-2 s
  later, so unscaled a placement outlives the whole session (each hint only refreshes it: hints
  become "placed once at turn 1, then sticky") and the 2 s debounce swallows many hints.
- `--hint-arrival` (the client's side, `HttpRun(hint_arrival=True)`): each hint says when its
  turn will arrive, so the placement lasts until then plus the TTL whatever the typing time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mode:
    name: str
    session_ids: bool  # send X-Session-Id
    hints: bool  # send typing hints
    env: dict = field(default_factory=dict)  # settings for every service of the stack


MODES = {
    "recompute": Mode("recompute", False, False, {"TANDEM_ENABLE_PREFIX_CACHING": "false"}),
    "sticky": Mode("sticky", True, False, {"TANDEM_SESSION_ROUTING": "sticky"}),
    "hints": Mode("hints", True, True, {}),
    "load-aware": Mode("load-aware", True, False, {"TANDEM_SESSION_ROUTING": "advisory"}),
    "recompute-cached": Mode("recompute-cached", False, False, {}),
}

# the keys that make a stack one mode or another: never set from outside the mode
MODE_KEYS = frozenset(k for m in MODES.values() for k in m.env) | {"TANDEM_SESSION_ROUTING"}

# the hint path's timers in human seconds (the services' defaults: advisory/settings.py,
# gateway/settings.py); `--scale-hint-timers` divides them by the bench's speedup
HUMAN_TIMERS_S = {
    "TANDEM_PLACEMENT_TTL_S": 30.0,
    "TANDEM_MAX_PLACEMENT_TTL_S": 300.0,
    "TANDEM_TYPING_DEBOUNCE_S": 2.0,
    # session 10: a hint without an arrival is taken to come 60 s later; a placement ends 2 s
    # after its turn arrives
    "TANDEM_DEFAULT_ARRIVAL_S": 60.0,
    "TANDEM_TURN_GRACE_S": 2.0,
}


def parse_stack_env(items: list[str] | None) -> dict[str, str]:
    """`KEY=VALUE` pairs (`--stack-env`, repeatable) as a dict; a malformed pair, a key that is
    not a Tandem setting, or one a mode defines is a clear error before any stack starts."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.startswith("TANDEM_"):
            raise ValueError(f"--stack-env wants TANDEM_KEY=VALUE, got {item!r}")
        if key in MODE_KEYS:
            raise ValueError(f"--stack-env {key}: the mode sets it ({', '.join(MODES)}); choose modes instead")
        out[key] = value.strip()
    return out


def scaled_hint_timers(speedup: float) -> dict[str, str]:
    """The hint path's human-time constants at the bench's speedup (as env settings)."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    return {k: f"{v / speedup:g}" for k, v in HUMAN_TIMERS_S.items()}


def stack_env(mode: Mode, extra: dict[str, str], speedup: float, scale_timers: bool) -> dict[str, str]:
    """Every service's settings for `mode`'s stack: the scaled timers, then `--stack-env`, then
    the mode's own keys (which `parse_stack_env` keeps `extra` from touching)."""
    env = scaled_hint_timers(speedup) if scale_timers else {}
    return {**env, **extra, **mode.env}
