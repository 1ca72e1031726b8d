"""Command-line options for the engine's cache forms, defined once for every command that
builds an engine (`tandem worker`, `tandem generate`, `tandem bench engine`), so their names,
choices and help cannot drift apart.

Each option defaults to None, meaning "the engine's (or the environment's) default": callers
pass on only what was given, which is what lets `tandem worker` flags override `TANDEM_*`
settings without hiding them.
"""

from __future__ import annotations

import argparse

CACHE_FORMS = ("auto", "kv", "hidden")  # EngineConfig.cache_form


def add_cache_form_options(p: argparse.ArgumentParser) -> None:
    """`--kv-heads-expand`, `--cache-form`, `--uncached-ratio` and `--uncached-source` (EngineConfig
    fields of the same names)."""
    p.add_argument(
        "--kv-heads-expand",
        action="store_true",
        default=None,
        help="repeat each KV head for its query heads: same outputs, MHA's KV memory shape",
    )
    p.add_argument(
        "--cache-form",
        default=None,
        choices=CACHE_FORMS,
        help="the hybrid cache: force KV or HIDDEN (layer inputs, K/V rebuilt each step) for every request",
    )
    p.add_argument(
        "--uncached-ratio",
        type=float,
        default=None,
        help="partial KV residency (eLLM): keep only the newest (1 - R) of each request's tokens' K/V in the "
        "pool and rebuild the oldest each step (0..0.95; checking and debugging, see docs/ellm.md)",
    )
    p.add_argument(
        "--uncached-source",
        default=None,
        choices=("rebuild", "host", "auto"),
        help="where partial residency gets the oldest tokens' K/V each step: rebuild them, or keep them in "
        "host swap space and read them layer by layer, or (policy ellm) the cheaper per step (docs/ellm.md)",
    )


def add_aptserve_options(p: argparse.ArgumentParser) -> None:
    """`--aptserve-price-switches` / `--no-aptserve-price-switches` (`EngineConfig.aptserve_price_switches`,
    `TANDEM_APTSERVE_PRICE_SWITCHES`): the `aptserve` policy's conversions priced in its knapsack."""
    p.add_argument(
        "--aptserve-price-switches",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="policy aptserve: price a conversion's or preemption's re-prefill in the knapsack, so a request "
        "keeps its form (HIDDEN included) unless the gain beats the re-prefill (not in the paper; measured worse "
        "in the simulator, hence off by default; needs the engine's cost model; docs/aptserve.md)",
    )
