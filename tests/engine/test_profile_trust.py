"""Cost profiles that can be trusted (engine/profile_trust.py, engine/profile_cache.py), on a
real tiny model: a profile records how it was taken; a cached profile taken on a loaded host,
one without that record (an older file) or one with a poor fit is measured again when the host
is quiet and used with a warning when it is not; a cached profile that misses a spot timing by
far is measured again before any policy plans from it.

No timing is asserted. Where a test needs the host "quiet" or "loaded" now it sets the load bound
far beyond any real load (1e5 per CPU) or below any (-1), and writes the condition it tests
into the profile file at 1e6 per CPU, so the host's real load cannot change the outcome.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from engine import EngineConfig, LLMEngine, profile_cache, profiling
from engine.cost_model import CostModel, PhaseFit
from engine.loader import resolve_model
from engine.profile_trust import Conditions, TrustBounds, doubts

QUIET, LOADED = 1e5, -1.0  # load bounds per CPU: every real host is under the first, over the second
ANY = dict(profile_min_cpu_share=0.0, profile_max_fit_error=1e5, profile_spot_check_factor=0.0)


def _config(path, **kw) -> EngineConfig:
    cfg = dict(
        model=str(path), dtype="float32", num_blocks=96, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256
    )
    return EngineConfig(**{**cfg, **kw})


def _target(path, **bounds) -> profiling.ProfileTarget:
    target = LLMEngine(_config(path)).profile_target()  # fcfs: the engine itself does not profile
    return replace(target, config=replace(target.config, **bounds))


@pytest.fixture(scope="module")
def measured_profile(tiny_model_dir) -> CostModel:
    """One real profile of the tiny Llama, whatever the host's load (judged by each test)."""
    return profiling.profile(_target(tiny_model_dir("llama")))


def _count_profiles(monkeypatch) -> list[int]:
    """Count fresh profiles (the real one still runs)."""
    calls: list[int] = []
    real = profiling.profile

    def counted(target):
        calls.append(1)
        return real(target)

    monkeypatch.setattr(profiling, "profile", counted)
    return calls


def test_a_profile_records_how_it_was_taken(measured_profile):
    meta = measured_profile.meta
    cond = Conditions.from_dict(meta["conditions"])
    assert cond is not None and cond.wall_s > 0 and cond.cpus_online >= 1 and cond.threads >= 1
    assert cond.load1_start >= 0 and cond.load1_end >= 0 and 0 <= cond.cpu_share <= 1.5 and cond.cpu_model
    assert cond.taken_at.endswith("Z") and cond.others_load_per_cpu >= 0
    assert meta["engine"]["model"] and meta["engine"]["max_num_seqs"] == 8
    assert set(meta["trust"]) == {"trusted", "doubts", "bounds"}
    # judged by the bounds, from what was recorded
    assert doubts(meta, TrustBounds(max_load_per_cpu=QUIET, min_cpu_share=0, max_fit_error=1e5)) == []
    loaded = doubts(meta, TrustBounds(max_load_per_cpu=LOADED, min_cpu_share=0, max_fit_error=1e5))
    assert len(loaded) == 1 and "per CPU from other work" in loaded[0]
    starved = doubts(meta, TrustBounds(max_load_per_cpu=QUIET, min_cpu_share=2.0, max_fit_error=1e5))
    assert len(starved) == 1 and "of a core" in starved[0]
    poor = doubts(meta, TrustBounds(max_load_per_cpu=QUIET, min_cpu_share=0, max_fit_error=-1))
    assert len(poor) == 2 and all("fit misses" in d for d in poor)


def test_bounds_come_from_the_config_then_the_environment(monkeypatch):
    assert TrustBounds.of(EngineConfig()) == TrustBounds()
    monkeypatch.setenv("TANDEM_PROFILE_MAX_LOAD_PER_CPU", "2.5")
    monkeypatch.setenv("TANDEM_PROFILE_SPOT_CHECK_FACTOR", "0")
    got = TrustBounds.of(EngineConfig(profile_max_fit_error=0.1))
    assert (got.max_load_per_cpu, got.spot_check_factor, got.max_fit_error) == (2.5, 0.0, 0.1)
    assert TrustBounds.of(EngineConfig(profile_max_load_per_cpu=0.7)).max_load_per_cpu == 0.7


def _spoiled(model: CostModel, how: str) -> CostModel:
    """`model` as a file with one reason for doubt: taken loaded, from before the record, poor fit."""
    meta = dict(model.meta)
    if how == "loaded":
        meta["conditions"] = {**meta["conditions"], "others_load_per_cpu": 1e6, "load1_start": 2e6}
    elif how == "old":
        for key in ("conditions", "trust", "engine"):
            meta.pop(key)
    else:
        meta["prefill_mape"] = 1e6
    return replace(model, meta=meta)


DOUBT = {"loaded": "per CPU from other work", "old": "no record of the host's load", "poor fit": "fit misses"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["loaded", "old", "poor fit"])
def test_a_doubtful_cached_profile_is_retaken_on_a_quiet_host_and_used_with_a_warning_on_a_loaded_one(
    tiny_model_dir, tmp_path, monkeypatch, caplog, measured_profile, how
):
    path = tiny_model_dir("llama")
    source = resolve_model(str(path))
    calls = _count_profiles(monkeypatch)
    file = profiling.profile_path(_target(path), source, tmp_path)
    bad = _spoiled(measured_profile, how)
    bad.save(file)
    # loaded now: used as it is, with a warning naming the doubt, and the record says so
    with caplog.at_level(logging.WARNING, logger="engine.profile_cache"):
        got = profile_cache.cached_profile(_target(path, profile_max_load_per_cpu=LOADED, **ANY), source, tmp_path)
    assert calls == [] and got.model == bad and CostModel.load(file) == bad
    assert got.record.status == "cached" and not got.record.trusted
    assert any(DOUBT[how] in d for d in got.record.doubts), got.record.doubts
    assert any("not trusted" in r.message and DOUBT[how] in r.message for r in caplog.records)
    # quiet now: measured again, saved over the doubtful file, and the record says why
    got = profile_cache.cached_profile(_target(path, profile_max_load_per_cpu=QUIET, **ANY), source, tmp_path)
    assert calls == [1] and got.record.status == "retaken"
    assert any(DOUBT[how] in r for r in got.record.replaced), got.record.replaced
    saved = CostModel.load(file)
    assert saved == got.model and saved.meta["conditions"]["others_load_per_cpu"] < QUIET
    assert got.record.trusted and got.record.path == str(file)
    # and that one is now reused
    again = profile_cache.cached_profile(_target(path, profile_max_load_per_cpu=QUIET, **ANY), source, tmp_path)
    assert calls == [1] and again.record.status == "cached" and again.model == saved


@pytest.mark.timeout(600)
def test_a_fresh_profile_taken_loaded_is_used_once_and_saved_as_untrusted(tiny_model_dir, tmp_path, caplog):
    path = tiny_model_dir("llama")
    source = resolve_model(str(path))
    with caplog.at_level(logging.WARNING, logger="engine.profile_cache"):
        got = profile_cache.cached_profile(_target(path, profile_max_load_per_cpu=LOADED, **ANY), source, tmp_path)
    assert got.record.status == "fresh" and not got.record.trusted
    assert any("per CPU from other work" in d for d in got.record.doubts)
    assert any("not trusted" in r.message for r in caplog.records)
    saved = json.loads(profiling.profile_path(_target(path), source, tmp_path).read_text())
    assert saved["meta"]["trust"]["trusted"] is False and saved["meta"]["conditions"]


def _wrong(model: CostModel, step_s: float) -> CostModel:
    """`model` with every step predicted at `step_s`, its record saying it was taken quietly."""
    phase = PhaseFit(0.0, 0.0, step_s)
    meta = {**model.meta, "conditions": {**model.meta["conditions"], "others_load_per_cpu": 0.0, "cpu_share": 1.0}}
    return replace(model, prefill=phase, decode=phase, meta={**meta, "prefill_mape": 0.0, "decode_mape": 0.0})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step_s", [30.0, 1e-9])
def test_a_cached_profile_that_misses_the_spot_check_is_retaken_before_bros_plans_from_it(
    tiny_model_dir, tmp_path, monkeypatch, measured_profile, step_s
):
    """A profile claiming 30 s decode steps (a tiny model's take milliseconds, hundreds at most
    on a loaded host), or 1 ns ones, written into the cache as if taken quietly: the engine's
    spot check finds it off by far more than 3x and profiles again; the BROS policy plans from
    the new one. With the spot check off the wrong file is used: the check is what catches it."""
    path = tiny_model_dir("llama")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    file = profiling.profile_path(_target(path), resolve_model(str(path)), tmp_path)
    bounds = dict(profile_max_load_per_cpu=QUIET, profile_min_cpu_share=0.0, profile_max_fit_error=1e5)
    _wrong(measured_profile, step_s).save(file)
    blind = LLMEngine(_config(path, policy="bros", profile_spot_check_factor=0.0, **bounds))
    assert blind.cost_model.decode.beta == step_s and blind.profile_record.status == "cached"
    engine = LLMEngine(_config(path, policy="bros", profile_spot_check_factor=3.0, **bounds))
    record = engine.profile_record
    assert record.status == "retaken" and any("timed now took" in r for r in record.replaced), record
    assert engine.cost_model.decode.beta != step_s and engine.scheduler.policy.cost_model is engine.cost_model
    assert CostModel.load(file) == engine.cost_model
    as_json = json.loads(json.dumps(record.as_dict()))  # the record is plain JSON, as the benches write it
    assert as_json["status"] == "retaken" and as_json["replaced"] == list(record.replaced)


@pytest.mark.timeout(300)
def test_a_given_profile_is_recorded_as_given(tiny_model_dir, tmp_path):
    cm = tmp_path / "given.json"
    CostModel(PhaseFit(1e-4, 0, 1e-3), PhaseFit(1e-4, 0, 1e-3), 1e9, {"note": "given"}).save(cm)
    engine = LLMEngine(_config(tiny_model_dir("llama"), policy="bros", cost_model_path=str(cm)))
    record = engine.profile_record.as_dict()
    assert record["status"] == "given" and record["path"] == str(cm) and record["trusted"] is False
    assert any("no record" in d for d in record["doubts"])
    assert LLMEngine(_config(tiny_model_dir("llama"))).profile_record is None  # fcfs plans from nothing


@pytest.mark.timeout(600)
def test_cli_lists_drops_and_retakes_cached_profiles(tiny_model_dir, tmp_path, monkeypatch, capsys, measured_profile):
    """`tandem profile --list/--drop/--retake` on a cache holding a profile measured here (trusted
    under the permissive bounds set) and an older one without a record of its load."""
    import torch

    from services.cli import main

    path = tiny_model_dir("llama")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    for name, value in (("MAX_LOAD_PER_CPU", QUIET), ("MIN_CPU_SHARE", 0), ("MAX_FIT_ERROR", 1e5)):
        monkeypatch.setenv(f"TANDEM_PROFILE_{name}", str(value))
    good = profiling.profile_path(_target(path), resolve_model(str(path)), tmp_path)
    measured_profile.save(good)
    _spoiled(measured_profile, "old").save(tmp_path / "profiles" / "old-one.json")

    def listed() -> dict[str, dict]:
        assert main(["profile", "--list", "--json"]) == 0
        return {r["key"]: r for r in json.loads(capsys.readouterr().out)["profiles"]}

    rows = listed()
    assert set(rows) == {good.stem, "old-one"}
    assert rows[good.stem]["trusted"] and rows[good.stem]["retakeable"] and rows[good.stem]["load_per_cpu_at_fit"] >= 0
    assert not rows["old-one"]["trusted"] and "no record" in rows["old-one"]["doubts"][0]
    assert main(["profile", "--list"]) == 0 and "old-one" in capsys.readouterr().out  # the table
    assert main(["profile", "--retake", "old"]) == 2  # nothing to re-take it with: a clear error
    assert "records no engine settings" in capsys.readouterr().err
    assert main(["profile", "--drop", "untrusted"]) == 0 and "dropped old-one" in capsys.readouterr().out
    assert set(listed()) == {good.stem}
    threads = torch.get_num_threads()
    try:
        assert main(["profile", "--retake", good.stem[:12]]) == 0
    finally:
        torch.set_num_threads(threads)
    assert f"re-took {good.stem}" in capsys.readouterr().out
    retaken = CostModel.load(good)
    assert retaken.meta["conditions"]["taken_at"] >= measured_profile.meta["conditions"]["taken_at"]
    assert retaken.meta["conditions"] != measured_profile.meta["conditions"]
    assert main(["profile", "--drop", good.stem]) == 0 and f"dropped {good.stem}" in capsys.readouterr().out
    assert listed() == {}
