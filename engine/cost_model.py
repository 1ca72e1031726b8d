"""Iteration-latency cost model (BROS §4.1): `α0·L^n + α1·L^n·L^a + β` per phase, plus swaps.

Features. For one phase (the prefill rows or the decode rows of a batch), with request i
computing `n_i` new tokens over a context of `a_i` tokens after the step:

    L^n = Σ n_i                 (tokens through the linear layers: weight-side work)
    L^n·L^a = Σ n_i · a_i       (query-key pairs: attention work)

so `PhaseFit.predict(ln, la)` is called with `la = Σ n_i·a_i / Σ n_i` (a token-weighted mean
context). This is our decision for the notes' decode-feature pitfall: the paper's literal
aggregate `(Σ n_i)·(Σ a_i)` grows with the *square* of the batch size for decodes although
attention work grows linearly; per-request products are the real work in both phases. A row
with exactly one new token is a decode (the runner treats it so, whatever its history).

Step time. `exec = prefill(…) + decode(…) − min(β_prefill, β_decode)` when both phases are
present: one forward pass pays its fixed overhead once, not twice (measured: summing both β
over-predicted mixed batches). Swaps take `swap_bytes / swap_bytes_per_s`; the step is
`max(exec, swap)` when copies overlap the forward pass (GPU copy streams) and `exec + swap`
otherwise (the CPU path copies before the forward pass, on the same cores).

File format (JSON, stable; `CostModel.save` / `CostModel.load`):

    {"format": "tandem-cost-model/1",
     "prefill": {"alpha0": s_per_token, "alpha1": s_per_token_pair, "beta": s},
     "decode":  {"alpha0": ..., "alpha1": ..., "beta": ...},
     "swap_bytes_per_s": float,
     "hidden_s_per_token": float,            (optional: absent where not measured)
     "hidden_free_rows": float, "hidden_free_s_per_token": float,   (optional: a roofline's knee)
     "prefix_step": {"overhead_s": s, "per_row_s": s, "per_token_s": s},  (optional: eLLM, below)
     "rebuild_step": {... as prefix_step, "per_pair_s": s, "error_s": s},  (optional: eLLM, below)
     "meta": {"model": str, "device": str, "dtype": str, "swap_overlaps": bool,
              "prefill_mape": float, "decode_mape": float, "mixed_mape": float, ...}}

Unknown keys in `meta` are kept; a missing `meta.swap_overlaps` means False.

The hybrid cache (docs/aptserve.md). `hidden_s_per_token` is what a step pays, on top of the
same batch in KV form, per token of HIDDEN context it rebuilds (the K/V projection of every
stored row, per layer, plus moving the rebuilt K/V): Apt-Serve's ρ is this times the block
size. It is a separate linear term, not folded into α0/α1, because it scales with the HIDDEN
requests' *context* (not their new tokens) and exists only for those rows; `None` where it
was not measured (a model that never picks HIDDEN, or a profile from before the term).

The rebuild's rows go through the step's own K/V projection GEMM (Apt-Serve's code runs one
K/V GEMM over the step's new tokens and the rebuilt rows), which streams W_k and W_v whatever
its row count. Below the GEMM's roofline knee (`hidden_free_rows` rows, the step's new
tokens counted first) a rebuilt row costs only its memory traffic
(`hidden_free_s_per_token`); past it, `hidden_s_per_token`. A roofline profile sets the knee
(`loadgen/sim/roofline.py`); a measured profile has none (0: every token at the full price,
what the profiler's linear fit measures).

Partial residency (docs/ellm.md). `prefix_step` is what a step pays, on top of the same batch
fully resident, when some rows read a non-resident prefix from host swap space
(`engine/prefix_profiling.py` measures it, in the way the engine reads, `meta.prefix_read`):
a fixed `overhead_s`, `per_row_s` per row that carries a prefix and `per_token_s` per prefix
token. Read through a per-layer scratch (`copy`) such a step leaves the compiled decode layers
and runs op by op, attends each prefix apart and copies it per layer; read in place (a CPU's
`in_place`) it is the resident step with other block ids and the terms measure what is left.
Without it only the copy is priced (`swap_bytes_per_s`), which on this CPU missed 98% of the
scratch path's real extra (docs/ellm.md). `rebuild_step` is the same measurement for a step
whose rows *rebuild* their prefixes (the rows `engine/rebuilt_prefix.py` appends), with a
term for the prefixes' own causal attention (`Σu²`): such a step leaves the compiled decode
path and runs its rows op by op, which pricing the rows as ordinary prefill rows missed.
`with_rebuilt_prefixes` is the one price of rebuilt rows, for the optimiser and the simulator;
a profile without the term (a roofline profile) prices them as prefill rows, as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "tandem-cost-model/1"


@dataclass(frozen=True)
class PhaseFit:
    alpha0: float  # seconds per new token
    alpha1: float  # seconds per (new token × context token) pair
    beta: float  # fixed seconds per forward pass

    def predict(self, ln: float, la: float) -> float:
        """Seconds for `ln` new tokens over a mean context of `la` tokens (0 when ln == 0)."""
        if ln <= 0:
            return 0.0
        return self.alpha0 * ln + self.alpha1 * ln * la + self.beta

    def predict_work(self, ln: float, work: float) -> float:
        """Same as `predict`, with the product feature `Σ n_i·a_i` given directly (O(1) sums)."""
        if ln <= 0:
            return 0.0
        return self.alpha0 * ln + self.alpha1 * work + self.beta

    def to_dict(self) -> dict:
        return {"alpha0": self.alpha0, "alpha1": self.alpha1, "beta": self.beta}


@dataclass(frozen=True)
class Sample:
    """One measured forward pass of a single phase: features and seconds."""

    ln: float  # Σ n_i
    work: float  # Σ n_i·a_i
    seconds: float


def fit(samples: Iterable[Sample | tuple[float, float, float]]) -> PhaseFit:
    """Least squares on relative error (each row weighted by 1/seconds), non-negative terms.

    Relative weighting keeps the many short passes from being ignored next to a few long
    ones; a coefficient that comes out negative is dropped and the rest refitted, so the
    model never predicts a negative time for a bigger batch.
    """
    import numpy as np

    rows = [s if isinstance(s, Sample) else Sample(*s) for s in samples]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 samples to fit a phase, got {len(rows)}")
    x = np.array([[r.ln, r.work, 1.0] for r in rows], dtype=np.float64)
    y = np.array([r.seconds for r in rows], dtype=np.float64)
    return PhaseFit(*nonneg_lstsq(x, y, 1.0 / np.maximum(y, 1e-9)))


def nonneg_lstsq(x, y, w) -> list[float]:
    """Weighted least squares with non-negative coefficients: drop a negative term and refit."""
    import numpy as np

    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        negative = [a for a, c in zip(active, coef) if c < 0]
        if not negative or len(active) == 1:
            break
        active.remove(negative[0])
    full = [0.0] * x.shape[1]
    for a, c in zip(active, coef):
        full[a] = max(float(c), 0.0)
    return full


def mape(phase: PhaseFit, samples: Iterable[Sample]) -> float:
    """Mean absolute percentage error of `phase` on `samples` (0.1 = 10%)."""
    errs = [abs(phase.predict_work(s.ln, s.work) - s.seconds) / s.seconds for s in samples]
    return sum(errs) / len(errs) if errs else 0.0


def phase_sums(rows: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(Σ n_i, Σ n_i·a_i) of `(num_new_tokens, num_context_tokens_after_step)` rows."""
    return sum(n for n, _ in rows), sum(n * a for n, a in rows)


@dataclass(frozen=True)
class PrefixStepFit:
    """The measured extra of a step whose rows read or rebuild non-resident prefixes (module
    docstring). `per_pair_s` prices a rebuilt prefix's causal attention over itself (`Σu²`
    query-key pairs; 0 for a host read, which attends nothing extra); `error_s` is the fit's
    stated error, its largest absolute residual over the points it was fitted to."""

    overhead_s: float  # once per step with any such row
    per_row_s: float  # per row that carries a prefix
    per_token_s: float  # per prefix token read or rebuilt
    per_pair_s: float = 0.0  # per query-key pair of the rebuilt prefixes' own attention
    error_s: float = 0.0  # largest |measured - fitted| over the fit's points

    def extra_s(self, rows: float, tokens: float, pairs: float = 0.0) -> float:
        """Seconds added to a step by `rows` rows carrying `tokens` prefix tokens (`pairs` =
        Σu² for rebuilt prefixes; 0 when none)."""
        if rows <= 0:
            return 0.0
        return self.overhead_s + self.per_row_s * rows + self.per_token_s * tokens + self.per_pair_s * pairs

    def to_dict(self) -> dict:
        out = {"overhead_s": self.overhead_s, "per_row_s": self.per_row_s, "per_token_s": self.per_token_s}
        if self.per_pair_s or self.error_s:
            out.update(per_pair_s=self.per_pair_s, error_s=self.error_s)
        return out


@dataclass(frozen=True)
class CostModel:
    prefill: PhaseFit
    decode: PhaseFit
    swap_bytes_per_s: float
    meta: dict = field(default_factory=dict, compare=False)
    hidden_s_per_token: float | None = None  # K/V rebuild per HIDDEN context token per step
    hidden_free_rows: float = 0.0  # K/V GEMM rows that ride under its weight streaming (module docstring)
    hidden_free_s_per_token: float = 0.0  # a rebuilt token's price below that knee (its memory traffic)
    prefix_step: PrefixStepFit | None = None  # eLLM: the measured extra of a host-read prefix step
    rebuild_step: PrefixStepFit | None = None  # eLLM: the measured extra of a step rebuilding prefixes

    def hidden_rho(self, block_size: int) -> float | None:
        """Apt-Serve's ρ: seconds of rebuild per block of HIDDEN context per step."""
        return None if self.hidden_s_per_token is None else self.hidden_s_per_token * block_size

    def hidden_seconds(self, hidden_context_tokens: int, step_rows: int = 0) -> float:
        """The rebuild a step of `step_rows` new tokens pays for `hidden_context_tokens` tokens
        of HIDDEN context (the knee's free rows first); an error when some are scheduled but
        the term was never measured (never a silent 0)."""
        if not hidden_context_tokens:
            return 0.0
        if self.hidden_s_per_token is None:
            raise ValueError("this cost model has no hidden_s_per_token: it cannot price HIDDEN rows")
        free = min(hidden_context_tokens, max(0, self.hidden_free_rows - step_rows))
        return free * self.hidden_free_s_per_token + (hidden_context_tokens - free) * self.hidden_s_per_token

    @property
    def swap_overlaps(self) -> bool:
        return bool(self.meta.get("swap_overlaps", False))

    def estimate(
        self,
        prefill: Sequence[tuple[int, int]],
        decode: Sequence[tuple[int, int]],
        swap_bytes: int = 0,
        overlap: bool | None = None,
    ) -> float:
        """Seconds for one step. Each tuple is `(num_new_tokens, num_context_tokens_after_step)`
        for one request; `overlap` defaults to the profile's `swap_overlaps`."""
        p_ln, p_work = phase_sums(prefill)
        d_ln, d_work = phase_sums(decode)
        return self.estimate_sums(p_ln, p_work, d_ln, d_work, swap_bytes, overlap)

    def estimate_sums(
        self,
        p_ln: float,
        p_work: float,
        d_ln: float,
        d_work: float,
        swap_bytes: float = 0,
        overlap: bool | None = None,
    ) -> float:
        """`estimate` from running sums, O(1): what the scheduler calls per candidate."""
        exec_s = self.exec_seconds(p_ln, p_work, d_ln, d_work)
        swap_s = swap_bytes / self.swap_bytes_per_s if swap_bytes else 0.0
        if self.swap_overlaps if overlap is None else overlap:
            return max(exec_s, swap_s)
        return exec_s + swap_s

    def with_rebuilt_prefixes(
        self, p_ln: float, p_work: float, d_ln: float, d_work: float, rows: int, tokens: int, pairs: int
    ) -> float:
        """Execution seconds of a step whose `rows` rows rebuild `tokens` prefix tokens (`pairs`
        = Σu²) on top of its own prefill and decode work: the measured `rebuild_step` where the
        profile has one (the whole extra of such a step, including that it leaves the compiled
        decode path), otherwise the rebuilt rows priced as prefill rows `(u, u)`. The `ellm`
        optimiser and the simulator both price rebuilt rows through this one function."""
        if self.rebuild_step is not None:
            return self.exec_seconds(p_ln, p_work, d_ln, d_work) + self.rebuild_step.extra_s(rows, tokens, pairs)
        return self.exec_seconds(p_ln + tokens, p_work + pairs, d_ln, d_work)

    def exec_seconds(self, p_ln: float, p_work: float, d_ln: float, d_work: float) -> float:
        both = p_ln > 0 and d_ln > 0
        shared = min(self.prefill.beta, self.decode.beta) if both else 0.0
        return self.prefill.predict_work(p_ln, p_work) + self.decode.predict_work(d_ln, d_work) - shared

    # -- persistence ------------------------------------------------------------------

    def to_dict(self) -> dict:
        out = {
            "format": FORMAT,
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "swap_bytes_per_s": self.swap_bytes_per_s,
            "meta": dict(self.meta),
        }
        if self.hidden_s_per_token is not None:
            out["hidden_s_per_token"] = self.hidden_s_per_token
        if self.hidden_free_rows:
            out["hidden_free_rows"] = self.hidden_free_rows
            out["hidden_free_s_per_token"] = self.hidden_free_s_per_token
        if self.prefix_step is not None:
            out["prefix_step"] = self.prefix_step.to_dict()
        if self.rebuild_step is not None:
            out["rebuild_step"] = self.rebuild_step.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a cost model file (format {data.get('format')!r}, expected {FORMAT!r})")
        try:
            return cls(
                PhaseFit(**data["prefill"]),
                PhaseFit(**data["decode"]),
                float(data["swap_bytes_per_s"]),
                dict(data.get("meta", {})),
                None if data.get("hidden_s_per_token") is None else float(data["hidden_s_per_token"]),
                float(data.get("hidden_free_rows", 0.0)),
                float(data.get("hidden_free_s_per_token", 0.0)),
                None if data.get("prefix_step") is None else PrefixStepFit(**data["prefix_step"]),
                None if data.get("rebuild_step") is None else PrefixStepFit(**data["rebuild_step"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed cost model: {exc}") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"cost model file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model file {path} is not JSON: {exc}") from None
        return cls.from_dict(data)
