"""Batched token sampler.

One call picks one token for each row of a float32 logits matrix [N, V]. Design goals:
speed on a small CPU at batch 64-256 x vocab ~50k, and per-request reproducibility.

Semantics (per row, in order): banned ids -> -inf; temperature scaling; top-k; top-p (over
the top-k-renormalised distribution); min-p (relative to the most likely token, so it
commutes with the truncations before it). Greedy rows (temperature 0 or top_k 1) take the
argmax of the (banned-masked) raw logits.

Sampling uses the exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d.,
computed in log space as argmax_i (y_i - log E_i) with E_i = -log U_i, so no softmax is
needed (y are the scaled logits; the normaliser is a per-row constant). The truncations only
decide which ids take part in the race. Noise is the dominant cost (one uniform + two logs
per entry), so a row races over as few ids as its own data allows:
  * top-k rows: the k best ids (k uniforms);
  * top-p rows whose nucleus lies within the best _NUCLEUS_CANDIDATES ids (typical for a
    real model): those ids;
  * other rows: the whole vocabulary (V uniforms, one per token id); top-p there is found
    by rejection (see `_race_top_p`), with an exact sort as the last resort.
Which case applies depends only on the row itself, and a row with a generator (seeded
request) draws all its noise from that generator, so a seeded request gives the same tokens
whichever other requests share the batch. Rows without one share the sampler's generator.

Logprobs are log_softmax of the ORIGINAL logits at the chosen id (the model's raw
distribution, as OpenAI reports them), not of the temperature-scaled / truncated one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import SamplingParams
from kernels.greedy import Argmax, torch_argmax

# Rounds of rejection top-p before falling back to an exact sort for the rows still open.
_TOP_P_MAX_ROUNDS = 8
# A top-p row whose nucleus lies within this many most likely ids samples among them only.
_NUCLEUS_CANDIDATES = 128
# Temperatures below this are treated as greedy.
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    """Chosen token per row; `logprobs` is None unless some row asked for it, in which case
    rows that did not ask hold NaN."""

    token_ids: list[int]
    logprobs: list[float] | None


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A per-request generator for a seeded request (None when unseeded).

    The engine keeps it for the request's lifetime and passes it to every `sample` call."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    """Stateless apart from the shared generator used by unseeded rows. `argmax` picks the
    first index of each row's maximum (`kernels.greedy`: the C++ op on a CPU, whose oracle is
    the default `torch.argmax`); greedy rows and full-vocabulary races use it."""

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu", argmax: Argmax = torch_argmax) -> None:
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._argmax = argmax

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of `logits` [N, V].

        `generators[i]` is row i's own generator (seeded request) or None. `banned_token_ids[i]`
        lists ids that row i must not produce (EOS / stop ids before min_tokens is reached).
        `logits` is never modified.
        """
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"need one params/generator per row: {n} rows, {len(params)} params, {len(generators)} generators"
            )
        if banned_token_ids is not None and len(banned_token_ids) != n:
            raise ValueError(f"banned_token_ids has {len(banned_token_ids)} entries for {n} rows")
        if logits.dtype != torch.float32:
            logits = logits.float()
        bans = banned_token_ids if _has_bans(banned_token_ids) else None

        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
        sampled = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if greedy:
            tokens[_idx(greedy, logits)] = self._argmax(_greedy_rows(logits, greedy, bans))
        if sampled:
            tokens[_idx(sampled, logits)] = self._sample_rows(logits, sampled, params, generators, bans)

        return SamplerOutput(token_ids=tokens.tolist(), logprobs=_logprobs(logits, tokens, params))

    # -- sampled rows -------------------------------------------------------------------

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        bans: Sequence[Sequence[int]] | None,
    ) -> torch.Tensor:
        """Tokens for the non-greedy rows `rows` (global indices), in that order."""
        ps = [params[i] for i in rows]
        y = _rows(logits, rows)  # a view of `logits` when rows is every row: copy before writing
        if bans is not None and any(len(bans[i]) for i in rows):
            y = y.clone() if y is logits else y
            _apply_bans(y, rows, bans)
        if any(p.temperature != 1.0 for p in ps):
            temps = torch.tensor([p.temperature for p in ps], dtype=y.dtype, device=y.device)
            y = y / temps.unsqueeze(1) if y is logits else y.div_(temps.unsqueeze(1))

        gens = [generators[i] for i in rows]
        out = torch.empty(len(rows), dtype=torch.long, device=y.device)
        full, topk_rows, topp_rows = [], [], []
        for j, p in enumerate(ps):
            if 0 < p.top_k < y.shape[1]:
                topk_rows.append(j)
            elif p.top_p < 1.0:
                topp_rows.append(j)
            else:
                full.append(j)
        if topk_rows:
            out[_idx(topk_rows, y)] = self._sample_top_k(y, topk_rows, ps, gens)
        if topp_rows:
            out[_idx(topp_rows, y)] = self._sample_top_p(y, topp_rows, ps, gens)
        if full:
            yf = _rows(y, full)
            score = self._race_scores(yf, [gens[j] for j in full])
            _apply_min_p(yf, score, [ps[j] for j in full])
            out[_idx(full, y)] = self._argmax(score)
        return out

    def _sample_top_k(
        self, y: torch.Tensor, rows: list[int], ps: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> torch.Tensor:
        """top-k (then top-p over the top-k-renormalised distribution, vLLM / HF order) on a
        [R, k_max] candidate slice: no vocabulary sort, and k uniforms per row instead of V."""
        ks = [ps[j].top_k for j in rows]
        vals, cand = y.index_select(0, _idx(rows, y)).topk(max(ks), dim=1)  # sorted descending
        # Positions beyond a row's own k are not candidates.
        k_t = torch.tensor(ks, device=y.device).unsqueeze(1)
        outside = torch.arange(vals.shape[1], device=y.device).unsqueeze(0) >= k_t
        vals.masked_fill_(outside, -math.inf)
        top_p = torch.tensor([ps[j].top_p for j in rows], dtype=y.dtype, device=y.device)
        if bool((top_p < 1.0).any()):
            probs = torch.softmax(vals, dim=1)
            mass_before = probs.cumsum(dim=1) - probs  # mass of strictly better candidates
            outside |= mass_before >= top_p.unsqueeze(1)
        _min_p_candidates(vals, outside, [ps[j] for j in rows])
        return self._race_candidates(vals, cand, outside, [gens[j] for j in rows], ks)

    def _sample_top_p(
        self, y: torch.Tensor, rows: list[int], ps: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> torch.Tensor:
        """top-p (without top-k). A row whose nucleus lies within its _NUCLEUS_CANDIDATES most
        likely ids (the usual case for a real model) races among those only; the others race
        over the whole vocabulary with rejection top-p (`_race_top_p`)."""
        yr = y.index_select(0, _idx(rows, y))
        probs = torch.softmax(yr, dim=1)
        top_p = torch.tensor([ps[j].top_p for j in rows], dtype=y.dtype, device=y.device)
        k = min(_NUCLEUS_CANDIDATES, y.shape[1])
        p_c, cand = probs.topk(k, dim=1)
        cum = p_c.cumsum(dim=1)
        fits = (cum[:, -1] >= top_p).tolist()
        small = [i for i, f in enumerate(fits) if f]
        large = [i for i, f in enumerate(fits) if not f]
        out = torch.empty(len(rows), dtype=torch.long, device=y.device)
        if small:
            si = _idx(small, y)
            outside = (cum[si] - p_c[si]) >= top_p[si].unsqueeze(1)
            vals = yr[si].gather(1, cand[si])
            sub = [rows[i] for i in small]
            _min_p_candidates(vals, outside, [ps[j] for j in sub])
            out[si] = self._race_candidates(vals, cand[si], outside, [gens[j] for j in sub], [k] * len(sub))
        if large:
            li = _idx(large, y)
            yl = _rows(yr, large)
            sub = [rows[i] for i in large]
            score = self._race_scores(yl, [gens[j] for j in sub])
            _apply_min_p(yl, score, [ps[j] for j in sub])
            out[li] = _race_top_p(_rows(probs, large), score, top_p[li])
        return out

    def _race_candidates(
        self,
        vals: torch.Tensor,
        cand: torch.Tensor,
        outside: torch.Tensor,
        gens: list[torch.Generator | None],
        sizes: list[int],
    ) -> torch.Tensor:
        """Exponential race over candidate slices; row j of a seeded request draws exactly
        sizes[j] uniforms (its own k), so its noise does not depend on the batch."""
        u = self._uniforms(vals, gens, sizes)
        score = torch.sub(vals, u.log_().neg_().log_(), out=u)
        score.masked_fill_(outside, -math.inf)
        return cand.gather(1, score.argmax(dim=1, keepdim=True)).squeeze(1)

    def _race_scores(self, y: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
        """y - log(E) with E = -log(U) ~ Exp(1): the exponential-race key per (row, token)."""
        u = self._uniforms(y, gens, [y.shape[1]] * y.shape[0])
        # log(-log U): U == 0 gives +inf (token loses the race; probability 2^-24, harmless).
        u.log_().neg_().log_()
        return torch.sub(y, u, out=u)

    def _uniforms(self, like: torch.Tensor, gens: list[torch.Generator | None], sizes: list[int]) -> torch.Tensor:
        """U[0,1) noise shaped like `like`. Seeded rows draw sizes[j] values from their own
        generator (callers mask the rest of the row); the other rows share
        one draw from the sampler's generator."""
        u = torch.empty_like(like)
        shared = [j for j, g in enumerate(gens) if g is None]
        if len(shared) == len(gens):
            return u.uniform_(generator=self._generator)
        for j, g in enumerate(gens):
            if g is not None:
                u[j, : sizes[j]].uniform_(generator=g)
                u[j, sizes[j] :] = 0.5  # masked by the caller; just keep it finite
        if shared:
            u[_idx(shared, u)] = torch.empty(len(shared), u.shape[1], dtype=u.dtype, device=u.device).uniform_(
                generator=self._generator
            )
        return u


# -- greedy ---------------------------------------------------------------------------------


def _is_greedy(p: SamplingParams) -> bool:
    # Dividing by a tiny temperature overflows float32 (inf - inf = NaN): it is argmax anyway.
    return p.is_greedy or p.temperature < _MIN_TEMPERATURE


def _greedy_rows(logits: torch.Tensor, rows: list[int], bans: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """The greedy rows of `logits` with their banned ids at -inf (a copy only when some are)."""
    need_ban = bans is not None and any(len(bans[i]) for i in rows)
    x = _rows(logits, rows, copy=need_ban)
    if need_ban:
        _apply_bans(x, rows, bans)
    return x


# -- truncation -----------------------------------------------------------------------------


def _apply_min_p(y: torch.Tensor, score: torch.Tensor, ps: list[SamplingParams]) -> None:
    """Exclude tokens with p < min_p * p_max, i.e. y < y_max + log(min_p), from the race.

    A ratio test, so it is unaffected by renormalisation and commutes with top-k / top-p."""
    rows = [j for j, p in enumerate(ps) if p.min_p > 0.0]
    if not rows:
        return
    idx = _idx(rows, y)
    yr = y.index_select(0, idx)
    log_min_p = torch.tensor([math.log(ps[j].min_p) for j in rows], dtype=y.dtype, device=y.device)
    cutoff = yr.amax(dim=1, keepdim=True) + log_min_p.unsqueeze(1)
    sr = score.index_select(0, idx)
    sr.masked_fill_(yr < cutoff, -math.inf)
    score[idx] = sr


def _min_p_candidates(vals: torch.Tensor, outside: torch.Tensor, ps: list[SamplingParams]) -> None:
    """min-p on a descending candidate slice: column 0 holds the row's maximum."""
    min_p = [p.min_p for p in ps]
    if not any(m > 0.0 for m in min_p):
        return
    log_min_p = torch.tensor(
        [math.log(m) if m > 0.0 else -math.inf for m in min_p], dtype=vals.dtype, device=vals.device
    )
    outside |= vals < vals[:, :1] + log_min_p.unsqueeze(1)


def _race_top_p(probs: torch.Tensor, score: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over the full vocabulary without sorting it (a 128 x 49k sort costs ~0.3 s here).

    Token j is in the nucleus iff the mass of tokens strictly more likely than j is < top_p.
    The winner of the race over the whole (min-p-masked) row is accepted if it is in the
    nucleus; otherwise every token at most as likely as it is outside the nucleus too, so
    they leave the race and the next winner is checked. With the same noise throughout, the
    accepted token is exactly the race winner over the nucleus. Usually one or two rounds;
    rows still open after `_TOP_P_MAX_ROUNDS` get the nucleus by sort (same answer).
    """
    sc = score
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)

    open_rows = torch.arange(probs.shape[0], device=probs.device)
    pr, s, tp = probs, sc, top_p
    for _ in range(_TOP_P_MAX_ROUNDS):
        win = s.argmax(dim=1, keepdim=True)
        p_win = pr.gather(1, win)
        better = pr > p_win
        mass_better = torch.where(better, pr, 0.0).sum(dim=1)
        accept = mass_better < tp
        out[open_rows[accept]] = win.squeeze(1)[accept]
        if bool(accept.all()):
            return out
        keep = ~accept
        open_rows, pr, s, tp, better = open_rows[keep], pr[keep], s[keep], tp[keep], better[keep]
        s.masked_fill_(~better, -math.inf)  # at most as likely as a rejected token: out

    out[open_rows] = _top_p_by_sort(pr, s, tp)
    return out


def _top_p_by_sort(probs: torch.Tensor, score: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Exact fallback: nucleus mask from a full sort, then the race winner inside it."""
    sorted_p, order = probs.sort(dim=1, descending=True)
    mass_before = sorted_p.cumsum(dim=1) - sorted_p
    outside_sorted = mass_before >= top_p.unsqueeze(1)
    outside = torch.empty_like(outside_sorted).scatter_(1, order, outside_sorted)
    score = score.masked_fill(outside, -math.inf)
    return score.argmax(dim=1)


# -- logprobs -------------------------------------------------------------------------------


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> list[float] | None:
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return None
    idx = _idx(rows, logits)
    x = _rows(logits, rows)
    chosen = x.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)
    lp = (chosen - torch.logsumexp(x, dim=1)).tolist()
    out = [math.nan] * len(params)
    for i, v in zip(rows, lp):
        out[i] = v
    return out


# -- helpers --------------------------------------------------------------------------------


def _idx(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def _rows(x: torch.Tensor, rows: list[int], copy: bool = False) -> torch.Tensor:
    """x[rows] without a copy when `rows` is all of x (and no copy was asked for)."""
    if len(rows) == x.shape[0] and rows == list(range(x.shape[0])):
        return x.clone() if copy else x
    return x.index_select(0, _idx(rows, x))


def _has_bans(banned: Sequence[Sequence[int]] | None) -> bool:
    return banned is not None and any(len(ids) for ids in banned)


def _apply_bans(x: torch.Tensor, rows: list[int], banned: Sequence[Sequence[int]] | None) -> bool:
    """Set banned logits to -inf in `x`, whose row j is global row rows[j]. True if any."""
    if banned is None:
        return False
    jr = [j for j, g in enumerate(rows) for _ in banned[g]]
    if not jr:
        return False
    jt = [t for g in rows for t in banned[g]]
    x[torch.tensor(jr, device=x.device), torch.tensor(jt, device=x.device)] = -math.inf
    return True
