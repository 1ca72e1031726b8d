"""What a step pays for the non-resident prefixes of partial residency (eLLM), by source.

`PrefixSources` says which sources the `ellm` optimiser may pick from and what a host read
costs; `host_step_seconds` prices a step whose prefixes are read from host, with eLLM's
layer-level split (docs/ellm.md, "Per-layer swap-in"):

- *rebuild*: the prefixes re-run as a prefill of `Σu` tokens (`Σu²` query-key pairs); the
  profiled cost model prices it (`CostModel.estimate_sums`), as before.
- *host*: every step reads `U = Σu` tokens' K/V of every layer from host swap space:
  `U · kv_bytes_per_token / swap_bytes_per_s`, measured by the profiler
  (`engine/profiling.py`). On a CPU the copy runs on the cores that run the step, so it adds
  to it; where copies overlap the step (a GPU's copy stream, the profile's `swap_overlaps`)
  the step takes `max(step, copy)`.
- *layer split* (priced, built only at its ends): keep layers `[0, l)` of a prefix on host
  plus the prefix's hidden state entering layer `l`, and rebuild layers `l..L-1` from it.
  Copy `(l + h)/L · U · c_h` (h = 0.5 layers for the hidden state when `0 < l < L`: exact for
  MHA, where a layer input is as wide as one of K, V; an underestimate for GQA) against a
  rebuild of `(L - l)/L` of the prefill. Summed on a CPU (then `l = L` or `l = 0` wins, the
  cost is linear in `l`), overlapped on a GPU (the best `l` balances the two). The engine runs
  only `l = L` (source `host`) and `l = 0` (source `rebuild`): a mixed split needs the runner
  to store a layer input and start the prefix rows at layer `l`, which is not built; the
  simulator prices the split so its worth can be judged first.

The measured penalty (`CostModel.prefix_step`, where the profiler measured it: an engine whose
`ellm` may read from host). Read through a per-layer scratch, a step with non-resident
prefixes leaves the compiled decode layers and attends each prefix op by op; on this CPU
that, not the copy, was most of what such a step cost (docs/ellm.md). Read in place (a CPU's
default since the sixth session) the step stays on the compiled path and the fit measures
what is left. Where it is measured, a host step costs `overhead + per_row·rows + per_token·U`
on top of the step without prefixes (`per_token` replacing the bandwidth-only copy price,
since it includes the copy), and a rebuild step pays `overhead + per_row·rows` on top of its
rebuilt rows (its own attention is in the prefill price). With the in-place fit that
rebuild penalty is an underestimate (rebuilt rows still leave the compiled path, which the
in-place fit no longer measures); left so because the rebuild's own prefill, ~600x a host
read per token here, already decides against it. Unmeasured (a simulator profile, a GPU),
the penalty is 0 and the copy is priced from the bandwidth, as before.

Host capacity: a host source needs `U` tokens of free host space (`host_capacity_tokens`);
past it the engine's component falls back to rebuilding, and the optimiser prices that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cost_model import CostModel, PrefixStepFit

SOURCES = ("rebuild", "host", "auto")  # what `ellm` may use: one source, or the cheaper per step


@dataclass(frozen=True)
class PrefixSources:
    rebuild: bool = True
    host: bool = False
    copy_s_per_token: float = 0.0  # seconds to read one token's K/V of all layers from host
    overlap: bool = False  # copies overlap the step (GPU copy stream) rather than add to it
    host_capacity_tokens: int = 0
    num_layers: int = 1
    layer_split: bool = False  # price eLLM's best split of layers between host and rebuild
    step: PrefixStepFit | None = None  # the measured penalty of a prefix step (module docstring)

    def off_graph_s(self, rows: int) -> float:
        """What `rows` rows with non-resident prefixes add to a step besides their prefix's own
        work: the measured fixed and per-row penalty, 0 where not measured."""
        if self.step is None or rows <= 0:
            return 0.0
        return self.step.overhead_s + self.step.per_row_s * rows

    @classmethod
    def of(
        cls,
        source: str,
        *,
        kv_bytes_per_token: int,
        swap_bytes_per_s: float,
        overlap: bool,
        host_capacity_tokens: int,
        num_layers: int = 1,
        layer_split: bool = False,
        step: PrefixStepFit | None = None,
    ) -> PrefixSources:
        """The sources `source` ("rebuild", "host" or "auto": both) allows, priced from the
        profile's host-link bandwidth and the KV's bytes per token, or from the measured
        `step` penalty where there is one."""
        if source not in SOURCES:
            raise ValueError(f"prefix source must be one of {', '.join(SOURCES)}, got {source!r}")
        host = source in ("host", "auto") and kv_bytes_per_token > 0 and swap_bytes_per_s > 0
        copy = kv_bytes_per_token / swap_bytes_per_s if host else 0.0
        return cls(
            rebuild=source in ("rebuild", "auto"),
            host=host,
            copy_s_per_token=copy if step is None or not host else step.per_token_s,
            overlap=overlap,
            host_capacity_tokens=host_capacity_tokens,
            num_layers=max(1, num_layers),
            layer_split=layer_split,
            step=step,
        )


REBUILD_ONLY = PrefixSources()


def split_shares(host_layers: int, num_layers: int) -> tuple[float, float]:
    """(share of a prefix's all-layer K/V bytes read from host, share of its prefill rebuilt)
    when layers `[0, host_layers)` are read and the rest rebuilt from the stored layer input."""
    hidden = 0.5 if 0 < host_layers < num_layers else 0.0
    return (host_layers + hidden) / num_layers, (num_layers - host_layers) / num_layers


def host_step_seconds(
    exec_s: float, rebuild_s: float, tokens: int, sources: PrefixSources, rows: int = 1
) -> tuple[float, int]:
    """`(step seconds, layers read from host)` of a step whose `tokens` prefix tokens of `rows`
    rows come from host (with the layer split when allowed): `exec_s` the step without
    prefixes, `rebuild_s` what rebuilding all of them would add (its off-graph penalty
    included). The split is the `l` in `0..L` with the least step time (`l = L` without
    `layer_split`)."""
    exec_s = exec_s + sources.off_graph_s(rows)
    rebuild_s = rebuild_s - sources.off_graph_s(rows)
    n = sources.num_layers
    if not sources.layer_split:  # all layers from host: the same arithmetic as below, without arrays
        copy = n / n * tokens * sources.copy_s_per_token
        rest = exec_s + 0 / n * rebuild_s
        return (max(rest, copy) if sources.overlap else rest + copy), n
    layers = np.arange(n + 1) if sources.layer_split else np.array([n])
    hidden = np.where((layers > 0) & (layers < n), 0.5, 0.0)  # the stored layer input read back
    copy = (layers + hidden) / n * tokens * sources.copy_s_per_token  # as `split_shares`
    rest = exec_s + (n - layers) / n * rebuild_s
    step = np.maximum(rest, copy) if sources.overlap else rest + copy
    best = int(np.argmin(step))
    return float(step[best]), int(layers[best])


def rebuild_step_seconds(
    cost: CostModel, sources: PrefixSources, b: int, work: int, rows: int, tokens: int, pairs: int
) -> float:
    """A step of `b` decode rows over `work` context tokens whose `rows` non-resident prefixes
    (`tokens` in all, `pairs` query-key pairs) are rebuilt: at their measured price where
    profiled (`with_rebuilt_prefixes`, shared with the simulator), otherwise as prefill rows plus
    the host fit's off-graph penalty."""
    rebuilt = cost.with_rebuilt_prefixes(0, 0, b, work, rows, tokens, pairs)
    return rebuilt + (0.0 if cost.rebuild_step is not None else sources.off_graph_s(rows))


def step_seconds(
    cost: CostModel, sources: PrefixSources, b: int, work: int, rows: int, tokens: int, pairs: int
) -> float:
    """The same step with its prefixes from the cheaper allowed source (`cheaper_source`)."""
    rebuild = rebuild_step_seconds(cost, sources, b, work, rows, tokens, pairs)
    if not tokens:
        return rebuild
    return cheaper_source(cost.estimate_sums(0, 0, b, work), rebuild, tokens, rows, sources)[0]


def cheaper_source(
    exec_s: float, rebuild_step: float, tokens: int, rows: int, sources: PrefixSources
) -> tuple[float, str, int]:
    """(step seconds, source, host layers) of the cheaper allowed source for `tokens` prefix
    tokens of `rows` rows; rebuilding where the host cannot take them (the component falls
    back the same way)."""
    if not (sources.host and tokens and tokens <= sources.host_capacity_tokens):
        return rebuild_step, "rebuild", 0
    host_step, layers = host_step_seconds(exec_s, rebuild_step - exec_s, tokens, sources, rows)
    if host_step < rebuild_step or not sources.rebuild:
        return host_step, "host", layers
    return rebuild_step, "rebuild", 0
