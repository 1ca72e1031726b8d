#!/usr/bin/env bash
# The GPU checks of issue 19, for the device machine (docs/gpu.md says how to call it).
#
#   tests/gpu/run_gpu_checks.sh tests         # CUDA tests: kernels (paged, partial + merge, HIDDEN, transient
#                                             # prefix), engine through Triton (KV, HIDDEN, partial residency),
#                                             # transformers parity
#   tests/gpu/run_gpu_checks.sh bench-qwen    # nano-vllm's benchmark shape on the Qwen3-0.6B architecture
#   tests/gpu/run_gpu_checks.sh bench-llama   # the same workload on the Llama-3-8B architecture
#   tests/gpu/run_gpu_checks.sh bench-qwen-hidden  # bench-qwen with every request in the HIDDEN form
#   tests/gpu/run_gpu_checks.sh breakdown-qwen [FLAGS]   # decode-step breakdown vs the roofline (step_breakdown.py)
#   tests/gpu/run_gpu_checks.sh breakdown-llama [FLAGS]  # the same on Llama-3-8B
#
# Each part fits one device call (10 minutes). Results go to $OUT (the device tool brings them
# back) or docs/results/gpu/ when OUT is unset; every JSON is stamped with the device, driver,
# library versions and the commit: the device gets a copy of the tree without its history, so
# pass COMMIT=$(git rev-parse --short HEAD) in the command. DEVICE, NUM_PROMPTS, KV_GIB,
# INPUT_LEN and OUTPUT_LEN ("LO HI") override the benchmark's device and size, for a dry run on
# the CPU: DEVICE=cpu NUM_PROMPTS=2 KV_GIB=1 INPUT_LEN="16 64" OUTPUT_LEN="4 8" OUT=/tmp/gpu-dry \
#   tests/gpu/run_gpu_checks.sh bench-qwen
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-docs/results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

stamp() {  # the environment of this run, as JSON
    "$py" - "$commit" <<'EOF'
import json, subprocess, sys
import torch, triton, transformers
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except FileNotFoundError:
    gpu = "none (no nvidia-smi)"
print(json.dumps({"commit": sys.argv[1], "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": triton.__version__, "transformers": transformers.__version__,
                  "python": sys.version.split()[0]}))
EOF
}

bench() {  # name, architecture, extra flags: nano-vllm's shape (256 sequences, input and output U(100, 1024), EOS ignored)
    # shellcheck disable=SC2086  # the "LO HI" pairs are meant to split
    "$py" -m services.cli bench engine --model "$2" --load-format dummy --device "${DEVICE:-cuda}" --dtype bfloat16 \
        --num-prompts "${NUM_PROMPTS:-256}" --input-len ${INPUT_LEN:-100 1024} \
        --output-len-range ${OUTPUT_LEN:-100 1024} --max-num-seqs 256 --max-num-batched-tokens 16384 \
        --kv-cache-gib "${KV_GIB:-40}" --seed 0 --json "$out/bench-$1.raw.json" "${@:3}"
    stamped "$out/bench-$1"
}

breakdown() {  # name, architecture, step_breakdown.py flags
    "$py" tests/gpu/step_breakdown.py --model "$2" --device "${DEVICE:-cuda}" --json "$out/breakdown-$1.raw.json" "${@:3}"
    stamped "$out/breakdown-$1"
}

stamped() {  # PATH: PATH.raw.json -> PATH.json with the run's environment under "gpu_run"
    "$py" - "$1.raw.json" "$1.json" "$(stamp)" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
result["gpu_run"] = json.loads(sys.argv[3])
json.dump(result, open(sys.argv[2], "w"), indent=2)
EOF
    rm "$1.raw.json"
}

case "${1:-tests}" in
    tests)
        stamp > "$out/tests-env.json"
        "$py" -m pytest -q -p no:cacheprovider -rs tests/gpu tests/kernels/test_triton_attention.py \
            tests/kernels/test_triton_partial.py tests/kernels/test_triton_hidden.py \
            tests/kernels/test_triton_resident.py tests/engine/test_triton_engine.py \
            tests/engine/test_hybrid_cache.py::test_hidden_rows_on_the_triton_kernels \
            tests/engine/test_partial_residency.py::test_triton_kernels_give_full_residency_tokens \
            2>&1 | tee "$out/tests.log"
        ;;
    bench-qwen) bench qwen3-0.6b qwen3-0.6b ;;
    bench-llama) bench llama-3-8b llama-3-8b ;;
    bench-qwen-hidden) bench qwen3-0.6b-hidden qwen3-0.6b --cache-form hidden ;;
    breakdown-qwen) breakdown qwen3-0.6b qwen3-0.6b "${@:2}" ;;
    breakdown-llama) breakdown llama-3-8b llama-3-8b "${@:2}" ;;
    bench) bench "$2" "$3" "${@:4}" ;;  # any NAME and MODEL (a built-in architecture or a config directory), bench flags
    *) echo "usage: $0 tests|bench-qwen|bench-llama|bench-qwen-hidden|breakdown-qwen|breakdown-llama|bench NAME MODEL [FLAGS]" >&2; exit 2 ;;
esac
