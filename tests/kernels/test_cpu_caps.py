"""The CPU capability probe: flags capped by our override and by torch's own ISA settings, and
dtype "auto" decided from it."""

from __future__ import annotations

import pytest

from kernels import cpu_caps

AMX = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile"}
ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
ZEN3 = {"avx2", "fma", "avx", "sse4_2"}


@pytest.fixture
def fake_cpu(monkeypatch):
    """Probe a CPU with the given flags, under the given environment."""

    def make(flags: set[str], **env: str) -> cpu_caps.CpuCaps:
        for var in (cpu_caps.ENV_OVERRIDE, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        monkeypatch.setattr(cpu_caps, "_read_cpuinfo", lambda: ("Test CPU", "TestVendor", set(flags)))
        cpu_caps.probe.cache_clear()
        return cpu_caps.probe()

    yield make
    cpu_caps.probe.cache_clear()


@pytest.mark.parametrize(
    "flags,isa,bf16",
    [(AMX, "amx", True), (ZEN4, "avx512", True), (ZEN3, "avx2", False), ({"sse4_2"}, "baseline", False)],
)
def test_levels_from_flags(fake_cpu, flags, isa, bf16):
    caps = fake_cpu(flags)
    assert (caps.isa, caps.native_bf16, caps.capped_by) == (isa, bf16, ())


@pytest.mark.parametrize(
    "env", [{"TANDEM_CPU_ISA": "avx2"}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}]
)
def test_any_cap_makes_an_amx_host_look_like_avx2(fake_cpu, env):
    caps = fake_cpu(AMX, **env)
    assert caps.isa == "avx2" and not caps.native_bf16
    assert not any(f.startswith(("avx512", "amx")) for f in caps.flags)
    assert len(caps.capped_by) == 1


def test_cap_above_the_hardware_changes_nothing(fake_cpu):
    caps = fake_cpu(ZEN3, TANDEM_CPU_ISA="amx", ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX")
    assert caps.isa == "avx2" and caps.capped_by == ()


def test_avx512_cap_hides_amx_but_keeps_avx512_bf16(fake_cpu):
    caps = fake_cpu(AMX, TANDEM_CPU_ISA="avx512")
    assert caps.isa == "avx512" and caps.native_bf16 and "amx_bf16" not in caps.flags


def test_unknown_override_is_a_clear_error(fake_cpu):
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA"):
        fake_cpu(AMX, TANDEM_CPU_ISA="sse9")


@pytest.mark.parametrize("flags,expected", [(AMX, "bfloat16"), (ZEN4, "bfloat16"), (ZEN3, "float32")])
def test_auto_dtype_on_cpu(fake_cpu, flags, expected):
    fake_cpu(flags)
    assert cpu_caps.resolve_dtype("auto", "cpu")[0] == expected


def test_explicit_dtype_is_kept_with_a_warning_when_emulated(fake_cpu, caplog):
    fake_cpu(ZEN3)
    assert cpu_caps.resolve_dtype("float32", "cpu") == ("float32", "requested")
    assert cpu_caps.resolve_dtype("bfloat16", "cpu") == ("bfloat16", "requested")
    assert "without native bf16" in caplog.text
    with pytest.raises(ValueError, match="dtype must be"):
        cpu_caps.resolve_dtype("int8", "cpu")


def test_engine_config_resolves_auto_once(fake_cpu):
    from engine.config import EngineConfig

    fake_cpu(ZEN3)
    cfg = EngineConfig()
    assert cfg.dtype == "auto"
    with pytest.raises(ValueError, match="resolved"):
        _ = cfg.torch_dtype
    resolved = cfg.resolved()
    # an AVX2 CPU runs float32 through the C++ kernel's AVX2 build (docs/engine.md, Decisions)
    assert resolved.dtype == "float32" and resolved.decode_kernel == "cpp" and resolved.resolved() is resolved


def test_this_machine_is_probed():
    """The real probe on the test host: a known level, and the stamp fields benchmarks record."""
    cpu_caps.probe.cache_clear()
    caps = cpu_caps.probe()
    assert caps.isa in cpu_caps.ISA_LEVELS and caps.logical_cpus >= 1 and caps.model
    assert set(caps.as_dict()) >= {"model", "isa", "native_bf16", "flags", "capped_by"}
