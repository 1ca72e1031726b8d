"""`tandem bench profile` (loadgen/bench/cpu_step_profile.py): a prefill and a decode step of
a tiny model profiled, every op's time in one category, the markdown table and the stamp."""

from __future__ import annotations

import argparse

import pytest

from loadgen.bench.cpu_step_profile import COLUMNS, category, markdown, profile


def test_categories_of_the_names_that_used_to_be_misfiled():
    # "to" as a substring filed the compiled region and Dynamo's guard lookup under index/copy
    assert category("Torch-Compiled Region: 0/0") == "compiled graph loops"
    assert category("TorchDynamo Cache Lookup") == "graph guards"
    assert category("## Call CompiledFxGraph fovzj6mftydrzygwu4vbeu5uez3vlf4krqbfg4bk6nyccxekohzp ##") == (
        "compiled graph loops"
    )
    assert category("mkldnn::_linear_pointwise") == "gemm"
    assert category("tandem_cpu::decode") == "attention"
    assert category("tandem_cpu::add_rms_norm") == "norms/rope/act"
    assert category("aten::to") == "index/copy"
    assert category("aten::argmax") == "sampling"


@pytest.mark.timeout(300)
def test_profile_of_a_tiny_model(tiny_model_dir):
    args = argparse.Namespace(
        model=str(tiny_model_dir("llama")),
        dtype="auto",
        fused_ops="auto",
        prefill_attention="auto",
        prefill_len=96,
        prefill_shape="workload",
        seqs=3,
        steps=1,
        kv_cache_gib=0.05,
    )
    out = profile(args)
    assert out["prefill"]["rows"] == 96
    assert out["decode"]["seqs"] == 3
    for kind in ("prefill", "decode"):
        step = out[kind]
        assert step["by_category_s"]["gemm"] > 0
        assert sum(step["by_category_s"].values()) == pytest.approx(step["op_s"])
        assert step["outside_ops_s"] == pytest.approx(step["profiled_wall_s"] - step["op_s"])
        assert set(step["by_category_s"]) <= set(COLUMNS)
        assert sum(step["ops_s"].values()) == pytest.approx(step["op_s"])
    assert out["provenance"]["dtype"] == out["dtype"] in ("float32", "bfloat16")
    table = markdown(out).splitlines()
    assert table[0].startswith("| step | wall (median) | gemm |")
    assert table[2].startswith("| prefill, 96 tokens |") and table[3].startswith("| decode, 3 rows |")
    assert out["provenance"]["git"]["commit"][:7] in table[-1]
