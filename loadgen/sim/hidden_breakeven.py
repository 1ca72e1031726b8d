"""`python -m loadgen.sim.hidden_breakeven`: when does Apt-Serve's hidden form pay? The
decode throughput of a full KV pool held all in HIDDEN form against the same pool all in KV,
from a cost model (a measured CPU profile or a GPU roofline), and the largest pool at which
HIDDEN wins (docs/aptserve.md, "When can HIDDEN pay (tenth session)").

*The model* (a fluid one: fractional rows, no block rounding). A pool of `P` tokens (in KV
form) full of requests of `n` context tokens decodes `P/n` rows in KV form; in HIDDEN form,
which takes `r` of KV's memory (`r = d / (2·kv_heads·head_dim)`, 1/2 for MHA), `P/(r·n)`
rows. A decode step is the cost model's decode price of those rows (`CostModel.estimate_sums`,
`β + α0·rows + α1·rows·n`), and a HIDDEN step adds the rebuild of every row's context
(`CostModel.hidden_seconds`, the simulator's own price: the roofline's knee included) and the
measured fixed cost of a step that has HIDDEN rows (`meta.hidden_step_overhead_s`: on the CPU
engine such a step runs op by op outside the compiled decode layer). Throughput is rows per
step over the step's seconds.

*The closed form* (no knee): HIDDEN wins iff `r·β + r·o + c·P < β`, i.e.

    P < P* = ((1 - r)·β - r·o) / c            (MHA: (β - o) / (2c))

with `β` the decode step's fixed cost, `o` the HIDDEN step's fixed extra and `c` the rebuild
per context token (`hidden_s_per_token`). It does not depend on the context length or the
batch size: rows scale as `P/n` and each row's rebuild as `n`, so the whole pool's rebuild is
`c·P/r` per step whatever the lengths. HIDDEN trades twice the rows for rebuilding the whole
pool every step; that pays only where the pool's rebuild costs less than the step's fixed
cost. In roofline terms (`β` ≈ streaming the weights, `12·d²·L` values; `c` = the K/V GEMM,
`4·d²·L` FLOPs) `P* ≈ 1.5·bytes_per_value·FLOPs/bytes_per_second`: a few hundred tokens on
any GPU at fp16, and tens of tokens on a CPU, whatever the model (docs/aptserve.md).

Writes one JSON document with the provenance stamp: per case the fit's terms, `P*` (closed
form, and the largest pool at which the priced ratio exceeds 1, which includes the knee: a
grid, refined by bisection), the ratio at the setup's own pool, the ρ at which HIDDEN would break even there against
the ρ measured, and the grid.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from engine.cost_model import CostModel


@dataclass(frozen=True)
class DecodePoint:
    """One full pool, all KV against all HIDDEN."""

    pool_tokens: float
    context: float
    kv_rows: float
    hidden_rows: float
    kv_step_s: float
    hidden_step_s: float
    rebuild_s: float  # of the HIDDEN step: its context's K/V rebuild
    ratio: float  # HIDDEN's decode tokens per second over KV's


def hidden_overhead_s(cost: CostModel) -> float:
    """The measured fixed extra of a step with HIDDEN rows (0 where the profile has none)."""
    return float(cost.meta.get("hidden_step_overhead_s", 0.0) or 0.0)


def full_pool_decode(cost: CostModel, pool_tokens: float, context: float, r: float = 0.5) -> DecodePoint:
    """Decode throughput of a pool of `pool_tokens` (KV-form tokens) full of `context`-token
    requests, all HIDDEN over all KV (module docstring)."""
    if cost.hidden_s_per_token is None:
        raise ValueError("this cost model has no hidden_s_per_token: it cannot price HIDDEN rows")
    if not 0 < r < 1:
        raise ValueError(f"the hidden form saves no memory at ratio {r} (GQA/MQA): HIDDEN never pays")
    kv_rows = pool_tokens / context
    hidden_rows = pool_tokens / (r * context)
    kv_step = cost.estimate_sums(0, 0, kv_rows, kv_rows * (context + 1))
    rebuild = cost.hidden_seconds(hidden_rows * context, step_rows=hidden_rows)
    hidden_step = cost.estimate_sums(0, 0, hidden_rows, hidden_rows * (context + 1)) + rebuild + hidden_overhead_s(cost)
    ratio = (hidden_rows / hidden_step) / (kv_rows / kv_step)
    return DecodePoint(pool_tokens, context, kv_rows, hidden_rows, kv_step, hidden_step, rebuild, ratio)


def closed_form_pool(cost: CostModel, r: float = 0.5) -> float:
    """`P* = ((1 - r)·β - r·o) / c`: the pool (KV-form tokens) below which HIDDEN decodes
    faster, for a price without a knee (0: never)."""
    c = cost.hidden_s_per_token
    if c is None or c <= 0:
        raise ValueError("P* needs a positive hidden_s_per_token")
    return max(0.0, ((1 - r) * cost.decode.beta - r * hidden_overhead_s(cost)) / c)


def breakeven_rho(cost: CostModel, pool_tokens: float, block_size: int, r: float = 0.5) -> float:
    """The ρ (s per block) at which HIDDEN would break even at this pool (no knee): the `c`
    solving `P = P*`, times the block size; 0 where the fixed extra alone outweighs the gain."""
    c = ((1 - r) * cost.decode.beta - r * hidden_overhead_s(cost)) / pool_tokens
    return max(0.0, c) * block_size


def pool_grid(lo: float, hi: float, points: int = 40) -> list[float]:
    """Geometric grid of pool sizes from `lo` to `hi` tokens."""
    step = (hi / lo) ** (1 / (points - 1))
    return [lo * step**i for i in range(points)]


def priced_pool(cost: CostModel, grid: list[DecodePoint], context: float, r: float = 0.5) -> float:
    """The largest pool of the grid at which HIDDEN wins, refined by bisection up to the next
    grid point (to 0.1%; 0 where it never wins on the grid)."""
    last = max((i for i, p in enumerate(grid) if p.ratio > 1), default=None)
    if last is None:
        return 0.0
    lo = grid[last].pool_tokens
    if last + 1 == len(grid):
        return lo
    hi = grid[last + 1].pool_tokens
    while hi - lo > 1e-3 * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if full_pool_decode(cost, mid, context, r).ratio > 1 else (lo, mid)
    return lo


def analyse(
    label: str, cost: CostModel, pool_tokens: float, context: float, block_size: int = 16, r: float = 0.5
) -> dict:
    """One case: the fit's terms, both P* and the setup pool's ratio (module docstring)."""
    grid = [full_pool_decode(cost, p, context, r) for p in pool_grid(2 * block_size, max(pool_tokens, 1e5))]
    setup = full_pool_decode(cost, pool_tokens, context, r)
    return {
        "label": label,
        "model": cost.meta.get("model"),
        "device": cost.meta.get("device"),
        "dtype": cost.meta.get("dtype"),
        "hidden_ratio_r": r,
        "decode_beta_s": cost.decode.beta,
        "decode_alpha0_s_per_row": cost.decode.alpha0,
        "hidden_s_per_token": cost.hidden_s_per_token,
        "hidden_free_rows": cost.hidden_free_rows,
        "hidden_free_s_per_token": cost.hidden_free_s_per_token,
        "hidden_step_overhead_s": hidden_overhead_s(cost),
        "rho_s_per_block": cost.hidden_rho(block_size),
        "breakeven_pool_tokens_closed_form": closed_form_pool(cost, r),
        "breakeven_pool_tokens_priced": priced_pool(cost, grid, context, r),
        "setup_pool_tokens": pool_tokens,
        "setup_context_tokens": context,
        "setup": asdict(setup),
        "breakeven_rho_at_setup_pool_s_per_block": breakeven_rho(cost, pool_tokens, block_size, r),
        "grid": [asdict(p) for p in grid],
    }


# The cases of docs/aptserve.md: (label, cost model, pool in KV tokens, mean context).
# Contexts: BROS's ShareGPT, 223 prompt + half of 235 output tokens mid-decode (~340); x 0.25
# on the CPU cells (`--length-scale 0.25`).
CASES = (
    ("A100-40GB OPT-13B (the paper's setup, roofline)", "opt-13b-a100-40gb", 13192, 340),
    ("CPU, default model MHA-expanded, fp32 (quiet profile, 48 blocks)",
     "docs/results/aptserve/cpu9/engine-default-quiet.profile.json", 768, 85),
    ("CPU, tiny random-weight OPT, 1 thread (busy profile, 48 blocks)",
     "docs/results/aptserve/cpu7/engine-tiny-opt-busy.profile.json", 768, 85),
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from loadgen.factory import load_cost_model
    from loadgen.provenance import stamp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost-model", default=None, help="one profile (file or shipped name); default: CASES")
    ap.add_argument("--pool-tokens", type=float, default=13192)
    ap.add_argument("--context", type=float, default=340)
    ap.add_argument("--ratio", type=float, default=0.5, help="hidden/KV memory ratio r (MHA: 0.5)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cases = CASES if args.cost_model is None else ((args.cost_model, args.cost_model, args.pool_tokens, args.context),)
    rows = []
    for label, profile, pool, context in cases:
        row = analyse(label, load_cost_model(profile), pool, context, r=args.ratio)
        row["cost_model"] = profile
        rows.append(row)
        brief = {k: v for k, v in row.items() if k != "grid"}
        print(json.dumps(brief), flush=True)
    if args.out:
        from pathlib import Path

        doc = {"config": vars(args), "cases": rows, "provenance": stamp().as_dict()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
