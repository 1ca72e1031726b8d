"""Symphony (session-aware KV placement): users served at a similar latency, vs recompute.

Simulator at Symphony's scale: Llama-3-8B on the H100 roofline profile, 16 workers, closed-loop
sessions (ShareGPT turns, human reading/typing pauses) at 64 to 512 users. Three ways to serve
a session's next turn: recompute its history wherever placement puts it (vLLM without prefix
caching across workers), and move its KV to the new worker at 100 Gbps (12.5 GB/s) before the
turn runs. The paper's claim: 8x the users of vLLM at a similar TPOT (64 users at 18 ms vs 512
at 20.5 ms).
"""

from __future__ import annotations

from loadgen.repro.base import Cell, PaperRow, Repro


class SymphonyRepro(Repro):
    name = "symphony"
    title = "Symphony: session-aware KV placement (advisory hints)"

    def cells(self, *, quick: bool, engine: bool) -> list[Cell]:
        users = ("64",) if quick else ("64", "128", "256", "512")
        duration = "60" if quick else "300"
        base = (
            "--workload",
            "sessions",
            "--arrival",
            "closed",
            "--duration",
            duration,
            "--workers",
            "16",
            "--cost-model",
            "llama-3-8b-h100",
        )
        cells = []
        for u in users:
            cells.append(Cell(f"sim-recompute-u{u}", (*base, "--users", u), ("fcfs",)))
            cells.append(Cell(f"sim-kv-transfer-u{u}", (*base, "--users", u, "--kv-bandwidth-gbps", "12.5"), ("fcfs",)))
        return cells

    def paper_rows(self) -> list[PaperRow]:
        return []  # the paper's figure is in users per latency, tabulated by `users_table` below

    def not_implemented(self) -> list[str]:
        return [
            "advisory hints arriving seconds ahead of a turn (prefetching the KV before the request): "
            "the simulator has no advisory path yet, so 'kv-transfer' moves KV when the turn arrives",
            "InferCept baseline and the load-imbalance figure (Fig. 14)",
            "the CPU engine at small scale: `tandem bench sessions` exists (docs/sessions.md) but is "
            "not wired into this command",
        ]

    def setup_notes(self) -> list[str]:
        return [
            "Paper figure (Fig. 12c/13c): vLLM 64 users -> 18 ms avg TPOT; Symphony 512 users -> 20.5 ms.",
            "Ours: TPOT p50 and TTFT p99 per user count, recompute vs KV transfer, from the cells below.",
        ]
