#!/usr/bin/env bash
# The GPU checks of issue 19, for the device machine (docs/gpu.md says how to call it).
#
#   tests/gpu/run_gpu_checks.sh tests         # CUDA tests: kernels (paged, partial + merge, HIDDEN, transient
#                                             # prefix), engine through Triton (KV, HIDDEN, partial residency),
#                                             # transformers parity
#   tests/gpu/run_gpu_checks.sh bench-qwen    # nano-vllm's benchmark shape on the Qwen3-0.6B architecture
#   tests/gpu/run_gpu_checks.sh bench-llama   # the same workload on the Llama-3-8B architecture
#
# Each part fits one device call (10 minutes). Results go to $OUT (the device tool brings them
# back) or docs/results/gpu/ when OUT is unset; every JSON is stamped with the device, driver,
# library versions and the commit: the device gets a copy of the tree without its history, so
# pass COMMIT=$(git rev-parse --short HEAD) in the command. DEVICE and NUM_PROMPTS override the
# benchmark's device and size (a dry run on the CPU).
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

bench() {  # name, architecture: nano-vllm's shape (256 sequences, input and output U(100, 1024), EOS ignored)
    "$py" -m services.cli bench engine --model "$2" --load-format dummy --device "${DEVICE:-cuda}" --dtype bfloat16 \
        --num-prompts "${NUM_PROMPTS:-256}" --input-len 100 1024 --output-len-range 100 1024 --max-num-seqs 256 \
        --max-num-batched-tokens 16384 --kv-cache-gib "${KV_GIB:-40}" --seed 0 --json "$out/bench-$1.raw.json"
    "$py" - "$out/bench-$1.raw.json" "$out/bench-$1.json" "$(stamp)" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
result["gpu_run"] = json.loads(sys.argv[3])
json.dump(result, open(sys.argv[2], "w"), indent=2)
EOF
    rm "$out/bench-$1.raw.json"
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
    bench) bench "$2" "$3" ;;  # any NAME and MODEL (a built-in architecture or a config directory)
    *) echo "usage: $0 tests|bench-qwen|bench-llama|bench NAME MODEL" >&2; exit 2 ;;
esac
