"""Per-request records, SLO checks and per-class run summaries.

Definitions (times in seconds; a request's tokens are timestamped when the client sees them):
- TTFT: first token time - arrival time.
- TBT samples: the gaps between consecutive output tokens (n - 1 of them for n tokens).
- P99 TBT: the 99th percentile (linear interpolation) of one request's own TBT samples
  (Apt-Serve's footnote 1). TPOT: (last token - first token) / (n - 1), the mean gap.
- Normalised latency: end-to-end latency / output tokens (BROS's RT metric).
- A request *meets* a deadline when its time is <= the deadline.
- ``slo_attainment`` (Apt-Serve): the fraction of requests whose TTFT and P99 TBT both meet
  their SLOs; requests that did not complete count as misses; a request with at most one
  output token has no TBT samples and meets the TBT part.
- ``ttft_attainment``: fraction of requests with TTFT met. ``tpot_attainment`` (BROS,
  fine-grained): mean over requests of the fraction of their TBT samples that meet the TPOT
  SLO (an unfinished request counts the tokens it never produced as misses).
  ``tpot_mean_attainment``: fraction of requests whose mean TPOT meets the SLO.
- ``token_attainment`` (BROS per-token deadlines, group size 1): over all expected tokens of
  the class, the fraction delivered within their deadline (TTFT for the first, TPOT for
  each later gap).
- Pooled ``tbt_p99_s`` of a class: the 99th percentile over all TBT samples of its requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

CLASSES = ("rt", "be", "all")


@dataclass
class RequestRecord:
    request_id: str
    req_class: str
    arrival_s: float  # seconds from the run's start
    prompt_tokens: int
    max_tokens: int
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    session_id: str | None = None
    worker: str | None = None
    turn: int = 0  # a session's turn index (0 for single-turn requests)
    usage_prompt_tokens: int | None = None  # what the server counted (HTTP targets)
    cached_tokens: int | None = None  # prompt tokens whose KV the server reused (OpenAI usage field)
    token_times_s: list[float] = field(default_factory=list)  # one entry per output token
    finish_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.finish_s is not None and self.error is None and self.finish_reason != "abort"

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None when there are no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def tbt_samples(rec: RequestRecord) -> list[float]:
    t = rec.token_times_s
    return [b - a for a, b in zip(t, t[1:])]


def ttft(rec: RequestRecord) -> float | None:
    return rec.token_times_s[0] - rec.arrival_s if rec.token_times_s else None


def tpot(rec: RequestRecord) -> float | None:
    t = rec.token_times_s
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def tbt_p99(rec: RequestRecord) -> float | None:
    return percentile(tbt_samples(rec), 99)


def e2e_latency(rec: RequestRecord) -> float | None:
    return rec.finish_s - rec.arrival_s if rec.completed else None


def normalized_latency(rec: RequestRecord) -> float | None:
    lat = e2e_latency(rec)
    return lat / rec.output_tokens if lat is not None and rec.output_tokens else None


def _met(value: float | None, slo: float | None) -> bool:
    return value is not None and (slo is None or value <= slo)


def ttft_ok(rec: RequestRecord) -> bool:
    return _met(ttft(rec), rec.slo_ttft_s)


def tbt_ok(rec: RequestRecord) -> bool:
    """P99 TBT within the TPOT SLO (vacuous with fewer than two tokens)."""
    if not rec.completed:
        return False
    p99 = tbt_p99(rec)
    return p99 is None or rec.slo_tpot_s is None or p99 <= rec.slo_tpot_s


def slo_ok(rec: RequestRecord) -> bool:
    """Apt-Serve: completed, TTFT met and P99 TBT met."""
    return rec.completed and ttft_ok(rec) and tbt_ok(rec)


def tpot_mean_ok(rec: RequestRecord) -> bool:
    if not rec.completed:
        return False
    v = tpot(rec)
    return v is None or rec.slo_tpot_s is None or v <= rec.slo_tpot_s


def tokens_on_time(rec: RequestRecord) -> tuple[int, int]:
    """(tokens within their deadline, tokens expected): BROS per-token deadlines."""
    expected = rec.output_tokens if rec.completed else max(rec.max_tokens, rec.output_tokens)
    on_time = int(ttft_ok(rec))
    gaps = tbt_samples(rec)
    on_time += sum(1 for g in gaps if rec.slo_tpot_s is None or g <= rec.slo_tpot_s)
    return on_time, max(expected, 1)


def gap_attainment(rec: RequestRecord) -> float:
    """The fraction of this request's inter-token gaps that meet the TPOT SLO."""
    gaps = tbt_samples(rec)
    expected = len(gaps) if rec.completed else max(rec.max_tokens - 1, len(gaps))
    if expected == 0:
        return 1.0 if rec.completed else 0.0
    met = sum(1 for g in gaps if rec.slo_tpot_s is None or g <= rec.slo_tpot_s)
    return met / expected


def request_row(rec: RequestRecord) -> dict:
    """One request's record plus its derived metrics, as written to results.json."""
    row = asdict(rec)
    row.update(
        completed=rec.completed,
        output_tokens=rec.output_tokens,
        ttft_s=ttft(rec),
        tpot_s=tpot(rec),
        tbt_p99_s=tbt_p99(rec),
        e2e_s=e2e_latency(rec),
        normalized_latency_s=normalized_latency(rec),
        ttft_ok=ttft_ok(rec),
        tbt_ok=tbt_ok(rec),
        slo_ok=slo_ok(rec),
    )
    return row


def summarize(records: Iterable[RequestRecord], elapsed_s: float) -> dict[str, dict]:
    """Summaries for the classes ``rt``, ``be`` and ``all``."""
    recs = list(records)
    return {cls: summarize_class([r for r in recs if cls == "all" or r.req_class == cls], elapsed_s) for cls in CLASSES}


def summarize_class(recs: list[RequestRecord], elapsed_s: float) -> dict:
    done = [r for r in recs if r.completed]
    ttfts = [v for v in (ttft(r) for r in recs) if v is not None]
    tpots = [v for v in (tpot(r) for r in done) if v is not None]
    gaps = [g for r in recs for g in tbt_samples(r)]
    norm = [v for v in (normalized_latency(r) for r in done) if v is not None]
    e2e = [v for v in (e2e_latency(r) for r in done) if v is not None]
    slo_recs = [r for r in recs if r.slo_ttft_s is not None or r.slo_tpot_s is not None]
    has_slo = bool(slo_recs)  # attainment is over requests that have SLOs (BE has none)
    on_time = [tokens_on_time(r) for r in slo_recs]
    out_tokens = sum(r.output_tokens for r in done)
    rate = (lambda n: n / elapsed_s) if elapsed_s > 0 else (lambda n: None)  # noqa: E731
    return {
        "requests": len(recs),
        "completed": len(done),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": _mean(ttfts),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "tpot_mean_s": _mean(tpots),
        "tbt_p99_s": percentile(gaps, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "normalized_latency_s": _mean(norm),
        "ttft_attainment": _frac(slo_recs, ttft_ok),
        "tpot_attainment": _mean([gap_attainment(r) for r in slo_recs]),
        "tpot_mean_attainment": _frac(slo_recs, tpot_mean_ok),
        "tbt_p99_attainment": _frac(slo_recs, tbt_ok),
        "slo_attainment": _frac(slo_recs, slo_ok),
        "token_attainment": (sum(a for a, _ in on_time) / sum(b for _, b in on_time)) if has_slo else None,
        "goodput_rps": rate(sum(1 for r in slo_recs if slo_ok(r))) if has_slo else None,
        "throughput_rps": rate(len(done)),
        "output_tokens_per_s": rate(out_tokens),
        "output_tokens": out_tokens,
        "elapsed_s": elapsed_s,
    }


def _mean(values: Sequence[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def _frac(recs: list[RequestRecord], pred) -> float | None:
    return sum(1 for r in recs if pred(r)) / len(recs) if recs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0 or math.isnan(b):
        return None
    return a / b
