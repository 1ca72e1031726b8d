"""The cost-profile cache: which profile an engine plans from, and the record of that choice.

Profiles are cached under `$TANDEM_CACHE_DIR/profiles/` (key: engine/profiling.py). Each read
judges the file again (engine/profile_trust.py: the load it was measured at, its measuring
thread's CPU share, its fit error) and, unless `profile_spot_check_factor` is 0, times two small
decode batches now against its prediction for them (`SpotCheck`, a few decode steps).

Decisions, and why:
- A trusted cached profile that passes the spot check is used (status "cached").
- A cached profile with doubts (taken loaded, a poor fit, no load record because it predates
  them, or a spot check off by more than the factor either way) is measured again when the
  host is quiet now (status "retaken"; the doubts are in the record's `replaced`), and used with
  a warning naming them when it is not: a profile measured on a loaded host would be no better,
  and on this 2-core machine a loaded default-model profile took 870 s (session 9). Never
  silently: the warning, the log and the record say so.
- A fresh profile taken on a loaded host is used for this run (the engine needs one to start)
  with a warning naming the load, and saved with its conditions, so the next start judges it
  untrusted and re-takes it once the host is quiet. It is not re-measured at once with back-off:
  the load on a shared host lasts tens of minutes, and each try costs minutes when it is loaded.
- A given profile (`cost_model_path`) is used as given; its record says whether its own
  conditions would pass (a simulator profile has none: "no record").

`ProfileRecord` is what each policy planned from (engine.profile_record); the benchmark
documents carry it per run (docs/engine.md, "Cost profiles"). `cached_profiles` and `drop`
serve `tandem profile --list/--drop`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine import profiling
from engine.cost_model import CostModel
from engine.loader.cache import default_cache_dir
from engine.prefix_profiling import prefix_step_current, rebuild_step_missing, with_prefix_step, with_rebuild_step
from engine.profile_trust import Conditions, TrustBounds, doubts, host_quiet, measured

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileRecord:
    """Which cost profile an engine planned from, and how far it can be trusted."""

    status: str  # "fresh", "cached", "retaken" (a cached one with doubts, measured again), "given", "uncached"
    trusted: bool  # no doubts (below), spot check included
    path: str | None  # the file; None for a profile of a built-in architecture (not cached)
    doubts: tuple[str, ...] = ()  # why it is not trusted
    replaced: tuple[str, ...] = ()  # "retaken": why the cached one was not used
    conditions: dict | None = None  # how it was measured (Conditions), None where not recorded
    fit_error: dict = field(default_factory=dict)  # prefill/decode/mixed MAPE
    spot_check: dict | None = None  # SpotCheck.as_dict() of a cached profile
    host_load_per_cpu: float | None = None  # the 1-minute load per CPU when the choice was made
    bounds: dict = field(default_factory=dict)

    def brief(self) -> dict:
        """The part a per-run row of a benchmark carries (`as_dict` has the rest)."""
        cond = self.conditions or {}
        return {
            "status": self.status,
            "trusted": self.trusted,
            "key": Path(self.path).stem if self.path else None,
            "load_per_cpu_at_fit": cond.get("others_load_per_cpu"),
            "fit_error": dict(self.fit_error),
            "doubts": list(self.doubts),
        }

    def as_dict(self) -> dict:
        cond = self.conditions or {}
        return {
            "status": self.status,
            "trusted": self.trusted,
            "path": self.path,
            "key": Path(self.path).stem if self.path else None,
            "load_per_cpu_at_fit": cond.get("others_load_per_cpu"),
            "cpu_share_at_fit": cond.get("cpu_share"),
            "taken_at": cond.get("taken_at"),
            "fit_error": dict(self.fit_error),
            "doubts": list(self.doubts),
            "replaced": list(self.replaced),
            "spot_check": self.spot_check,
            "host_load_per_cpu": self.host_load_per_cpu,
            "conditions": self.conditions,
            "bounds": dict(self.bounds),
        }


@dataclass(frozen=True)
class Planned:
    model: CostModel
    record: ProfileRecord


@dataclass(frozen=True)
class SpotCheck:
    """A cached profile against now: two small decode batches timed (the fastest of three
    interleaved runs after a warm-up, as the profiler times) beside its prediction for them."""

    points: tuple[dict, ...]  # {"batch", "context", "measured_s", "predicted_s"}
    ratio: float  # geometric mean of measured / predicted over the points

    def misses(self, factor: float) -> bool:
        """Off by more than `factor` either way (0: never): stale, or taken on another host."""
        return factor > 0 and not 1 / factor <= self.ratio <= factor

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "points": list(self.points)}


def spot_check(target: profiling.ProfileTarget, model: CostModel) -> SpotCheck | None:
    """Time the decode grid's first point (one row, shortest context) and a batch of four at a
    longer context where the pool holds it, and compare with `model` (None: nothing fits)."""
    grid = profiling._decode_grid(target)
    if not grid:
        return None
    first = grid[0]
    fours = [p for p in grid if p[0] >= 4]
    wider = next((p for p in fours if p[1] > first[1]), fours[0] if fours else first)
    picks = list(dict.fromkeys([first, wider]))
    rows = [[(1, c - 1)] * b for b, c in picks]
    times = profiling._Bench(target).fastest_each(rows)
    points = tuple(
        {"batch": b, "context": c, "measured_s": t, "predicted_s": model.estimate([], profiling._after_step(r))}
        for (b, c), r, t in zip(picks, rows, times)
    )
    logs = [math.log(p["measured_s"] / p["predicted_s"]) for p in points if min(p["measured_s"], p["predicted_s"]) > 0]
    return SpotCheck(points, math.exp(sum(logs) / len(logs)) if logs else math.inf)


def cached_profile(target: profiling.ProfileTarget, source, cache_dir: Path | None = None) -> Planned:
    """The profile to plan from for `target` (module docstring: the decisions)."""
    bounds = TrustBounds.of(target.config)
    path = profiling.profile_path(target, source, cache_dir)
    cached = _read(path)
    replaced: list[str] = []
    if cached is not None:
        found = doubts(cached.meta, bounds, target.config.device)
        spot = spot_check(target, cached) if bounds.spot_check_factor > 0 else None
        if spot is not None and spot.misses(bounds.spot_check_factor):
            found.append(
                f"two decode steps timed now took {spot.ratio:.3g}x its prediction "
                f"(bound {bounds.spot_check_factor:g}x either way)"
            )
        quiet, load = host_quiet(bounds, torch.get_num_threads())
        if not found or not quiet:
            model = _with_missing_terms(target, cached, path)
            record = _record("cached", path, model, bounds, load.per_cpu, spot, extra=found)
            if not record.trusted:
                log.warning(
                    "planning from the cached cost profile %s although it is not trusted (%s): the host is loaded "
                    "now (load %.2f per CPU, bound %g), where a new profile would be no better; it is measured "
                    "again at a start on a quiet host",
                    path,
                    "; ".join(record.doubts),
                    load.per_cpu,
                    bounds.max_load_per_cpu,
                )
            return Planned(model, record)
        replaced = found
        log.warning("measuring the cost profile again: the cached %s is not trusted (%s)", path, "; ".join(found))
    model = profiling.profile(target)
    model.save(path)
    record = _record("retaken" if replaced else "fresh", path, model, bounds, None, None, replaced=replaced)
    _log_fresh(record, model)
    return Planned(model, record)


def fresh_profile(target: profiling.ProfileTarget) -> Planned:
    """A profile that is not cached (a built-in architecture has no files to key one on)."""
    model = profiling.profile(target)
    record = _record("uncached", None, model, TrustBounds.of(target.config), None, None)
    _log_fresh(record, model)
    return Planned(model, record)


def given_profile(path: str | Path, config) -> Planned:
    """A profile the configuration names: used as given, judged for the record only."""
    model = CostModel.load(path)
    return Planned(model, _record("given", Path(path), model, TrustBounds.of(config), None, None))


def cached_profiles(cache_dir: Path | None = None) -> list[tuple[Path, CostModel | None]]:
    """Every cached profile file, newest first, with its model (None: unreadable)."""
    folder = (cache_dir or default_cache_dir()) / "profiles"
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []
    return [(f, _read(f)) for f in files]


def _read(path: Path) -> CostModel | None:
    if not path.exists():
        return None
    try:
        return CostModel.load(path)
    except ValueError:
        log.warning("ignoring unreadable cost profile %s", path)
        return None


def _with_missing_terms(target: profiling.ProfileTarget, model: CostModel, path: Path) -> CostModel:
    """`model` with the terms this target needs and the file lacks measured now (the hybrid
    cache's ρ, eLLM's prefix and rebuild steps) and saved; how they were measured goes to
    `meta["additions_conditions"]`, judged like the profile's own."""
    steps = []
    if target.calibrate_hidden and model.hidden_s_per_token is None:
        steps.append(profiling.with_hidden)
    if target.calibrate_prefix and not prefix_step_current(target, model):
        steps.append(with_prefix_step)
    if target.calibrate_rebuild and rebuild_step_missing(target, model):
        steps.append(with_rebuild_step)
    if not steps:
        return model

    def add() -> CostModel:
        out = model
        for step in steps:
            out = step(target, out)
        return out

    model, conditions = measured(add, torch.get_num_threads())
    model = replace(model, meta={**model.meta, "additions_conditions": conditions.as_dict()})
    model.save(path)
    return model


def _record(
    status: str,
    path: Path | None,
    model: CostModel,
    bounds: TrustBounds,
    load_per_cpu: float | None,
    spot: SpotCheck | None,
    extra: list[str] | None = None,
    replaced: list[str] | None = None,
) -> ProfileRecord:
    meta = model.meta
    # a spot check's doubt is already in `extra`; the file's own are judged again after any additions
    own = doubts(meta, bounds, str(meta.get("device", "cpu")))
    found = list(dict.fromkeys([*own, *(extra or [])]))
    cond = Conditions.from_dict(meta.get("conditions") or {})
    return ProfileRecord(
        status=status,
        trusted=not found,
        path=str(path) if path is not None else None,
        doubts=tuple(found),
        replaced=tuple(replaced or ()),
        conditions=cond.as_dict() if cond is not None else None,
        fit_error={k: meta.get(f"{k}_mape") for k in ("prefill", "decode", "mixed")},
        spot_check=spot.as_dict() if spot is not None else None,
        host_load_per_cpu=load_per_cpu,
        bounds=bounds.as_dict(),
    )


def _log_fresh(record: ProfileRecord, model: CostModel) -> None:
    if record.trusted:
        log.info("cost model profiled in %.1f s, saved to %s", model.meta.get("profile_seconds", 0.0), record.path)
        return
    log.warning(
        "the cost profile just measured is not trusted (%s); it is used for this run%s",
        "; ".join(record.doubts),
        f" and saved as such to {record.path}: a start on a quiet host measures it again" if record.path else "",
    )
