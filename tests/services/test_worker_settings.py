"""`WorkerSettings` takes its engine fields from `EngineConfig` (same names, types, defaults),
reads them from the documented `TANDEM_*` variables, and hands them back as the engine's config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from services.worker.settings import WorkerSettings


def test_every_engine_field_is_a_worker_setting_with_the_engine_default():
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert f.name in WorkerSettings.model_fields, f.name
        if f.name != "session_dir":  # the worker derives it from its data directory and id
            assert WorkerSettings.model_fields[f.name].default == getattr(defaults, f.name), f.name
    names = WorkerSettings.env_names()
    for documented in ("TANDEM_DTYPE", "TANDEM_KV_CACHE_GIB", "TANDEM_MAX_NUM_SEQS", "TANDEM_COMPILE_LAYERS"):
        assert documented in names


def test_environment_reaches_the_engine_config(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_DTYPE", "float32")
    monkeypatch.setenv("TANDEM_KV_CACHE_GIB", "0.25")
    monkeypatch.setenv("TANDEM_MAX_MODEL_LEN", "512")
    monkeypatch.setenv("TANDEM_COMPILE_LAYERS", "false")
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "32")  # a field the worker never copied by hand
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    settings = WorkerSettings(policy="rr")  # a flag wins over the environment
    config = settings.engine_config(settings.resolved_session_dir("w1"))
    assert (config.dtype, config.kv_cache_gib, config.max_model_len, config.compile_layers) == (
        "float32",
        0.25,
        512,
        False,
    )
    assert config.block_size == 32 and config.policy == "rr" and config.num_threads is None
    assert Path(config.session_dir) == tmp_path / "workers" / "w1" / "sessions"
    unchanged = {f.name for f in dataclasses.fields(EngineConfig)} - {
        "dtype",
        "kv_cache_gib",
        "max_model_len",
        "compile_layers",
        "block_size",
        "policy",
        "session_dir",
    }
    for name in unchanged:
        assert getattr(config, name) == getattr(EngineConfig(), name), name


def test_bad_engine_values_are_refused_and_settings_are_frozen(monkeypatch):
    monkeypatch.setenv("TANDEM_KV_CACHE_GIB", "lots")
    with pytest.raises(ValidationError, match="kv_cache_gib"):
        WorkerSettings()
    monkeypatch.delenv("TANDEM_KV_CACHE_GIB")
    with pytest.raises(ValidationError):
        WorkerSettings().dtype = "float16"


@pytest.mark.parametrize(("flag", "value"), [([], False), (["--aptserve-price-switches"], True)])
def test_aptserve_price_switches_is_a_worker_flag(flag, value, tmp_path):
    """`tandem worker --aptserve-price-switches` reaches the engine (off by default: the paper's rule)."""
    from services.cli import build_parser
    from services.worker.cli_worker import settings_from_args

    args = build_parser().parse_args(["worker", "--policy", "aptserve", *flag])
    settings = settings_from_args(args)
    config = settings.engine_config(tmp_path)
    assert config.policy == "aptserve" and config.aptserve_price_switches is value
    off = build_parser().parse_args(["worker", "--no-aptserve-price-switches"])
    assert settings_from_args(off).aptserve_price_switches is False
