"""Profiling a real (tiny) model: the fitted cost model is sane, cached by model+device+dtype,
reloaded instead of re-measured, and `tandem profile` prints it."""

from __future__ import annotations

import json

import pytest

from engine import EngineConfig, LLMEngine, profile_cache, profiling
from engine.cost_model import CostModel
from engine.loader import resolve_model
from engine.prefix_profiling import with_prefix_step


def _config(path, **kw) -> EngineConfig:
    cfg = dict(
        model=str(path), dtype="float32", num_blocks=96, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256
    )
    return EngineConfig(**{**cfg, **kw})


@pytest.fixture
def one_thread():
    """Profile single-threaded: on an oversubscribed machine a two-thread pass stalls at every
    OpenMP barrier whose partner lost its core, so its times measure the neighbours (seen: a 1 ms
    pass timed at 85-500 ms); one thread only loses time slices, which the minimum of the
    profiler's interleaved passes filters. The fit's accuracy bound below assumes it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def trusting(monkeypatch):
    """These tests are about what is measured and what is cached, not whether a profile can be
    trusted (tests/engine/test_profile_trust.py): every profile passes, whatever the host's load
    now or when it was measured, and there is no spot check, so whether a cached profile is
    reused never depends on the load."""
    for name, value in (("MAX_LOAD_PER_CPU", "1e9"), ("MIN_CPU_SHARE", "0"), ("MAX_FIT_ERROR", "1e9")):
        monkeypatch.setenv(f"TANDEM_PROFILE_{name}", value)
    monkeypatch.setenv("TANDEM_PROFILE_SPOT_CHECK_FACTOR", "0")


# How many times a test measures before it judges a fit of timings: see `_accurate`.
MEASURE_TRIES = 3


def _accurate(meta: dict) -> bool:
    """The fit's bounds: in-sample fit of ~1 ms passes on a shared machine, single-phase error
    under 60%, the unfitted mixed batches under 100% (measured at load ~12 on 2 cores: at most
    32% and 47%; the back-to-back timing this replaced gave fits 25-92x off at load ~8)."""
    return meta["prefill_mape"] < 0.6 and meta["decode_mape"] < 0.6 and meta["mixed_mape"] < 1.0


@pytest.mark.timeout(300)
def test_profile_is_cached_and_reused(tiny_model_dir, tmp_path, monkeypatch, one_thread):
    """The fit's error is judged on timings of this machine, which a burst of load can spoil
    (0.6046 against 0.6 once at load ~50): so the profile is measured again, up to
    `MEASURE_TRIES` times (each in its own cache directory), and one accurate fit is what the
    test needs; every try's errors are in the failure. The bound itself is not loosened."""
    path = tiny_model_dir("llama")
    engine = LLMEngine(_config(path)).profile_target()
    tries = []
    for i in range(MEASURE_TRIES):
        cache_dir = tmp_path / f"try{i}"
        model = profiling.profile_cached(engine, resolve_model(str(path)), cache_dir=cache_dir)
        tries.append({k: model.meta[k] for k in ("prefill_mape", "decode_mape", "mixed_mape")})
        if _accurate(model.meta):
            break
    assert _accurate(model.meta), tries
    files = list((cache_dir / "profiles").glob("*.json"))
    assert len(files) == 1 and "float32" in files[0].name and "cpu" in files[0].name
    assert CostModel.load(files[0]) == model
    for phase in (model.prefill, model.decode):
        assert min(phase.alpha0, phase.alpha1, phase.beta) >= 0 and phase.predict(64, 64) > 0
    meta = model.meta
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["num_samples"] >= 10
    assert model.swap_bytes_per_s > 0 and meta["swap_overlaps"] is False
    monkeypatch.setattr(profiling, "profile", lambda e: pytest.fail("re-profiled although cached"))
    assert profiling.profile_cached(engine, resolve_model(str(path)), cache_dir=cache_dir) == model
    other = LLMEngine(_config(path, max_num_seqs=4)).profile_target()  # another grid: another key
    assert profiling.profile_path(other, resolve_model(str(path)), cache_dir) != files[0]


@pytest.mark.timeout(300)
def test_bros_engine_loads_a_given_cost_model(tiny_model_dir, tmp_path):
    cm_path = tmp_path / "cm.json"
    from engine.cost_model import PhaseFit

    CostModel(PhaseFit(1e-4, 0, 1e-3), PhaseFit(1e-4, 0, 1e-3), 1e9, {"note": "given"}).save(cm_path)
    engine = LLMEngine(_config(tiny_model_dir("llama"), policy="bros", cost_model_path=str(cm_path)))
    assert engine.cost_model.meta == {"note": "given"} and engine.scheduler.policy.cost_model is engine.cost_model


@pytest.mark.timeout(300)
def test_cli_profile_prints_json(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from services.cli import main

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    out = tmp_path / "copy.json"
    rc = main(
        [
            "profile",
            "--model",
            str(tiny_model_dir("llama")),
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "0.01",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["format"] == "tandem-cost-model/1" and CostModel.load(out).to_dict() == printed
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


@pytest.mark.timeout(300)
def test_hidden_rebuild_is_measured_on_mha_and_feeds_aptserve(tiny_model_dir, tmp_path, monkeypatch):
    """ρ calibration (docs/aptserve.md): on an MHA model (tiny OPT) the profile carries a
    positive `hidden_s_per_token` from timed HIDDEN decode batches, added to a cached profile
    that lacks it; aptserve without an override takes ρ = that × block size."""
    path = tiny_model_dir("opt")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    target = LLMEngine(_config(path)).profile_target()
    assert target.calibrate_hidden
    source = resolve_model(str(path))
    file = profiling.profile_path(target, source, tmp_path)
    without = profiling.profile(profiling.ProfileTarget(**{**target.__dict__, "calibrate_hidden": False}))
    assert without.hidden_s_per_token is None
    monkeypatch.setattr(profiling, "profile", lambda t: pytest.fail("re-profiled although cached"))
    # A positive slope is a property of timings on this machine, which a burst of load can
    # flatten: measured again (from the same cached profile without it) up to MEASURE_TRIES times.
    measured = []
    for _ in range(MEASURE_TRIES):
        without.save(file)  # a cached profile from before the term: it gets it added, not redone
        model = profiling.profile_cached(target, source, tmp_path)
        measured.append(model.hidden_s_per_token)
        if model.hidden_s_per_token is not None and model.hidden_s_per_token > 0:
            break
    assert model.hidden_s_per_token is not None and model.hidden_s_per_token > 0, measured
    points = model.meta["hidden_points"]
    assert len(points) >= 2 and len({p["tokens"] for p in points}) >= 2
    assert CostModel.load(file) == model and CostModel.load(file).hidden_s_per_token == model.hidden_s_per_token
    engine = LLMEngine(_config(path, policy="aptserve"))  # no aptserve_rho: the cached profile's ρ
    assert engine.scheduler.policy.rho_for(16) == pytest.approx(model.hidden_s_per_token * 16)
    assert LLMEngine(_config(path, policy="aptserve", aptserve_rho=0.5)).scheduler.policy.rho_for(16) == 0.5


def test_gqa_model_is_not_calibrated_and_aptserve_does_not_profile(tiny_model_dir, monkeypatch):
    """Where the hidden form saves nothing (tiny GQA Llama) ρ is never used: no calibration,
    and aptserve starts without profiling."""
    path = tiny_model_dir("llama")
    monkeypatch.setattr(profile_cache, "cached_profile", lambda *a, **k: pytest.fail("profiled"))
    engine = LLMEngine(_config(path, policy="aptserve"))
    assert not engine.profile_target().calibrate_hidden and engine.cost_model is None


@pytest.mark.timeout(300)
def test_host_prefix_step_is_measured_for_ellm_and_added_to_a_cached_profile(
    tiny_model_dir, tmp_path, monkeypatch, one_thread
):
    """eLLM's host-read prefix step (engine/prefix_profiling.py): an `ellm` engine that may read
    prefixes from host measures what such a step adds over the same batch fully resident, and a
    cached profile from before the term gets it added, not redone. On the tiny Llama, whose
    decode steps run through compiled layers, leaving them costs a measurable amount: the fit
    predicts a positive extra at the grid's largest point. An engine that only rebuilds does
    not measure it."""
    path = tiny_model_dir("llama")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    cfg = dict(num_host_blocks=256, rt_tpot_s=0.5)
    target = LLMEngine(_config(path, **cfg)).profile_target()
    assert not target.calibrate_prefix
    target = profiling.ProfileTarget(**{**target.__dict__, "calibrate_prefix": True})
    source = resolve_model(str(path))
    file = profiling.profile_path(target, source, tmp_path)
    without = profiling.profile(profiling.ProfileTarget(**{**target.__dict__, "calibrate_prefix": False}))
    assert without.prefix_step is None
    without.save(file)
    monkeypatch.setattr(profiling, "profile", lambda t: pytest.fail("re-profiled although cached"))
    model = profiling.profile_cached(target, source, tmp_path)
    step = model.prefix_step
    assert step is not None and min(step.overhead_s, step.per_row_s, step.per_token_s) >= 0
    points = model.meta["prefix_points"]
    assert len(points) >= 3 and len({p["rows"] for p in points}) >= 2
    largest = max(points, key=lambda p: p["tokens"])
    assert step.extra_s(largest["rows"], largest["tokens"]) > 0
    assert CostModel.load(file) == model and CostModel.load(file).prefix_step == step
    assert target.kv.host.num_free == 256  # every host block given back
    assert model.meta["prefix_read"] == "copy"  # the fcfs engine's storage keeps swap space apart
    # an engine that reads through the scratch too takes the cached profile as is
    copying = LLMEngine(_config(path, policy="ellm", uncached_source="auto", host_prefix_in_place=False, **cfg))
    assert copying.profile_target().calibrate_prefix and copying.cost_model.prefix_step == step
    # one that reads in place (a CPU's default) measures its own way, once, into the same file
    engine = LLMEngine(_config(path, policy="ellm", uncached_source="auto", **cfg))
    assert engine.profile_target().prefix_read == "in_place" and engine.cost_model.meta["prefix_read"] == "in_place"
    assert engine.cost_model.prefix_step is not None and CostModel.load(file) == engine.cost_model
    again = LLMEngine(_config(path, policy="ellm", uncached_source="auto", **cfg))
    assert again.cost_model == engine.cost_model  # cached: not measured a second time
    rebuild_only = LLMEngine(_config(path, policy="ellm", uncached_source="rebuild", **cfg))
    assert not rebuild_only.profile_target().calibrate_prefix
    # ...but every ellm engine that may rebuild measures the rebuilt prefix step (seventh
    # session), once, into the cached profile: the auto engine above already did
    assert engine.profile_target().calibrate_rebuild and engine.cost_model.rebuild_step is not None
    assert rebuild_only.profile_target().calibrate_rebuild
    assert rebuild_only.cost_model.rebuild_step == engine.cost_model.rebuild_step
    assert len(engine.cost_model.meta["rebuild_points"]) >= 5


@pytest.mark.parametrize("host_blocks, points", [(0, 0), (2, 1), (256, 4)])
def test_prefix_grid_needs_pool_and_host_space_and_degrades_without(host_blocks, points):
    """The host-read prefix grid keeps the points the pool and the host space hold (the tiny
    test pool: batch 1 and 4 of (64, 32) and (128, 96)); with fewer than three the profile is
    returned as it is, with a warning, and nothing runs (copy-only pricing, no start failure)."""
    from engine.cost_model import PhaseFit
    from engine.kv import BlockPool, KVCacheManager
    from engine.prefix_profiling import prefix_grid

    kv = KVCacheManager(BlockPool(96, True), 16, bytes_per_token=64, host_blocks=host_blocks)
    fail = lambda *a: pytest.fail("timed a batch although the grid is too small")  # noqa: E731
    target = profiling.ProfileTarget(fail, fail, kv, EngineConfig(max_num_seqs=8), 256, 1000, "t", "cpp", True)
    assert len(prefix_grid(target)) == points
    if points < 3:
        model = CostModel(PhaseFit(1e-3, 0.0, 0.01), PhaseFit(1e-3, 0.0, 0.01), 1e9)
        assert with_prefix_step(target, model) is model
