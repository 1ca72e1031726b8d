"""The fused C++ elementwise ops against a plain copy of the same bytes (issue 15).

A measurement tool (JSON out, with the provenance stamp every result carries):

    python -m loadgen.bench.cpu_elementwise --rows 64 1024 --json OUT.json

For each op of `kernels/cpu/elementwise.cpp` (add + RMSNorm, q/k norm + RoPE, SiLU * up, the
one-layer KV write), each ISA target this CPU runs (`avx512_bf16`/`avx512`, `avx2`), float32
and bfloat16, and each row count (a decode step's rows, a prefill chunk's), at the default
model's shape (SmolLM2-135M: hidden 576, MLP 1536, 9 query and 3 KV heads of 64): the op's
time and its bytes moved (each input read once, each output written once), against
`torch.Tensor.copy_` of a buffer whose read + write bytes are the same, timed interleaved
with the op so both see the same machine. `ratio` = op time / copy time: 1.0 means the op
runs at the speed of moving its bytes, the best an elementwise pass can do; at decode sizes
both are dominated by the per-call cost (dispatch, the OpenMP region), which is reported
by timing the op on a single row.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
NUM_BLOCKS, BLOCK_SIZE, MAX_POS = 1024, 16, 8192


def _cases(ns, rows: int, dtype: torch.dtype):
    """(name, bytes moved, callable) for each op on `rows` rows."""
    es = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    residual, delta, weight = rnd(rows, HIDDEN), rnd(rows, HIDDEN), rnd(HIDDEN)
    qkv = rnd(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POS, (rows,), generator=g)
    cos, sin = rnd(MAX_POS, HEAD_DIM), rnd(MAX_POS, HEAD_DIM)
    gate_up = rnd(rows, 2 * INTER)
    kv = torch.zeros(1, 2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, dtype=dtype)
    k, v = rnd(1, rows, KV_HEADS, HEAD_DIM), rnd(1, rows, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:rows].contiguous()
    return [
        # residual and delta read, residual and out written
        ("add_rms_norm", 4 * rows * HIDDEN * es, lambda: ns.add_rms_norm(residual, delta, weight, 1e-5)),
        # q and k rows read and written in place, a cos and a sin row per token
        (
            "qk_norm_rope",
            (2 * (HEADS + KV_HEADS) + 2) * rows * HEAD_DIM * es,
            lambda: ns.qk_norm_rope(qk, positions, cos, sin, HEADS, None, None, 1e-5),
        ),
        ("silu_mul", 3 * rows * INTER * es, lambda: ns.silu_mul(gate_up)),
        ("write_kv", 4 * rows * KV_HEADS * HEAD_DIM * es, lambda: ns.write_kv(kv, k, v, slots)),
    ]


def _time_pair(op, copy, repeats: int, inner: int) -> tuple[float, float]:
    """Median seconds per call of `op` and `copy`, timed in alternation."""
    op_t, copy_t = [], []
    for _ in range(3):  # warm up
        op()
        copy()
    for _ in range(repeats):
        for fn, out in ((op, op_t), (copy, copy_t)):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) / inner)
    return statistics.median(op_t), statistics.median(copy_t)


def measure(target: str, rows_list: list[int], repeats: int, inner: int) -> list[dict]:
    from kernels.cpu import elementwise

    ns = elementwise.ops(target)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            for name, nbytes, op in _cases(ns, rows, dtype):
                half = max(1, nbytes // 2)  # a copy of `half` bytes moves `nbytes`
                src, dst = torch.empty(half, dtype=torch.uint8), torch.empty(half, dtype=torch.uint8)
                op_s, copy_s = _time_pair(op, functools.partial(dst.copy_, src), repeats, inner)
                results.append(
                    {
                        "target": target,
                        "dtype": str(dtype).removeprefix("torch."),
                        "op": name,
                        "rows": rows,
                        "bytes": nbytes,
                        "op_us": op_s * 1e6,
                        "copy_us": copy_s * 1e6,
                        "op_gb_s": nbytes / op_s / 1e9,
                        "copy_gb_s": nbytes / copy_s / 1e9,
                        "ratio": op_s / copy_s,
                    }
                )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 1024])
    p.add_argument("--targets", nargs="*", default=None, help="ISA targets (default: every one this CPU runs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from kernels.cpu import build

    if args.threads:
        torch.set_num_threads(args.threads)
    native = build.target_for()
    targets = args.targets or ([native, "avx2"] if native and native != "avx2" else [native or "avx2"])
    load_before = os.getloadavg()
    results = [r for t in targets for r in measure(t, args.rows, args.repeats, args.inner)]
    out = {
        "threads": torch.get_num_threads(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "results": results,
    }
    for r in results:
        print(
            f"{r['target']:12s} {r['dtype']:9s} {r['op']:13s} rows={r['rows']:5d} "
            f"op {r['op_us']:8.1f} us {r['op_gb_s']:6.1f} GB/s | copy {r['copy_us']:7.1f} us "
            f"{r['copy_gb_s']:6.1f} GB/s | ratio {r['ratio']:.2f}"
        )
    from loadgen.bench.common import write_json
    from loadgen.provenance import stamp

    out["provenance"] = stamp().as_dict()
    write_json(out, args.json)
    print(json.dumps({k: out[k] for k in ("threads", "load_avg_before", "load_avg_after")}))


if __name__ == "__main__":
    main()
