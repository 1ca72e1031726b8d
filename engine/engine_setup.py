"""What `LLMEngine` builds and checks once at start from its config, apart from the step.

Functions of explicit inputs (the resolved `EngineConfig`, the model's config, parts built
before them), so the engine's constructor reads as the order of construction and the engine
module keeps only the request and step paths. No behaviour of their own: each is what the
engine's constructor did inline before it was split out (issue 15, module size).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import profile_cache
from engine.config import EngineConfig, ModelConfig
from engine.cost_model import CostModel
from engine.kv import BlockPool, KVCacheManager, KVCacheStorage, num_blocks_for_budget
from engine.kv.hidden import HiddenBlocks, HiddenLayout
from engine.kv.partial import check_ratio, check_source
from engine.kv.storage import bytes_per_block
from engine.profile_cache import Planned
from engine.profiling import ProfileTarget
from engine.rebuilt_prefix import reads_host_prefix_in_place
from engine.scheduling import SLO, Request

log = logging.getLogger(__name__)


def check_partial_residency(config: EngineConfig) -> None:
    """The combinations partial residency refuses, before anything is loaded (docs/ellm.md)."""
    check_ratio(config.uncached_ratio)
    if config.policy != "ellm" or config.uncached_source != "auto":  # "auto": ellm picks per step
        check_source(config.uncached_source)
    if config.policy == "bros":
        raise ValueError(
            "uncached_ratio > 0 cannot be combined with policy 'bros': BROS shares one block between "
            "two requests' ends, and a shared block cannot leave the pool for one of them (docs/ellm.md)"
        )
    if config.policy == "ellm" and config.uncached_ratio:
        raise ValueError("policy 'ellm' chooses the uncached ratio itself each step: leave uncached_ratio at 0")
    if config.cache_form == "hidden" or config.policy == "aptserve":
        raise ValueError(
            "partial residency (uncached_ratio > 0, policy 'ellm') does not combine with the hybrid cache's "
            "HIDDEN form (cache_form='hidden', policy 'aptserve'): both rebuild K/V in the step's last rows"
        )


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The engine's context limit: the model's, or a smaller `config.max_model_len`."""
    limit = model.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context of {limit} tokens")
    return config.max_model_len


def make_kv_cache(
    config: EngineConfig, model: ModelConfig, device: torch.device
) -> tuple[KVCacheManager, KVCacheStorage]:
    """The KV pool's manager and storage, sized by `num_blocks` or the `kv_cache_gib` budget,
    with host blocks for swaps and checkpoints."""
    dtype = config.torch_dtype
    num_blocks = config.num_blocks or num_blocks_for_budget(model, config.block_size, dtype, config.kv_cache_gib)
    pool = BlockPool(num_blocks, config.enable_prefix_caching)
    block_bytes = bytes_per_block(model, config.block_size, dtype)
    host_blocks = config.num_host_blocks
    if host_blocks is None:
        host_blocks = int(config.swap_space_gib * 2**30) // block_bytes
    in_place = reads_host_prefix_in_place(config)
    storage = KVCacheStorage(model, num_blocks, config.block_size, dtype, device, host_blocks, in_place)
    kv = KVCacheManager(
        pool, config.block_size, bytes_per_token=block_bytes // config.block_size, host_blocks=host_blocks
    )
    return kv, storage


def attach_hidden_cache(
    config: EngineConfig, model: ModelConfig, kv: KVCacheManager, storage: KVCacheStorage
) -> HiddenBlocks | None:
    """The hybrid cache's component (engine/kv/hidden.py), attached first so it owns the
    HIDDEN requests whatever the policy attaches after it; None when no request can be
    HIDDEN (cache_form "kv", or the bros policy, which swaps and shares blocks)."""
    if config.policy == "bros":
        if config.cache_form == "hidden":
            raise ValueError("cache_form='hidden' does not combine with the bros policy (it swaps blocks)")
        return None
    if config.cache_form == "kv":
        return None
    layout = HiddenLayout.of(model, config.block_size, storage.num_blocks)
    forced = config.cache_form == "hidden"
    log.log(logging.WARNING if forced and not layout.saves_memory else logging.INFO, layout.describe())
    return kv.attach(HiddenBlocks.factory(layout))


def aptserve_needs_rho(config: EngineConfig, hidden: HiddenBlocks | None) -> bool:
    """aptserve profiles for ρ unless given one, and for the re-prefill price of a conversion
    unless conversions are unpriced; only where it may pick HIDDEN: on a model where the
    hidden form saves nothing neither is used."""
    return (
        config.policy == "aptserve"
        and (config.aptserve_rho is None or config.aptserve_price_switches)
        and hidden is not None
        and hidden.layout.saves_memory
    )


def policy_options(
    config: EngineConfig,
    cost_model: CostModel | None,
    num_layers: int,
    in_session: Callable[[Request], bool],
) -> dict:
    """The keyword arguments `make_policy(config.policy, ...)` takes for this config.
    `in_session(r)`: whether r is a session turn (ellm keeps those resident, docs/ellm.md)."""
    if config.policy == "aptserve":
        if config.cache_form != "auto":
            raise ValueError("the aptserve policy chooses each request's cache form: use cache_form='auto'")
        return {
            "rho": config.aptserve_rho,
            "cost_model": cost_model,
            "decay": config.aptserve_decay,
            "price_switches": config.aptserve_price_switches,
            "default_slo": SLO(config.rt_ttft_s, config.rt_tpot_s),
        }
    if config.policy == "ellm":
        return {
            "cost_model": cost_model,
            "default_slo": SLO(None, config.rt_tpot_s),
            "excluded": in_session,
            "source": config.uncached_source,
            "num_layers": num_layers,
        }
    if config.policy != "bros":
        return {}
    return {
        "cost_model": cost_model,
        "default_slo": SLO(config.rt_ttft_s, config.rt_tpot_s),
        "base_cap": config.bros_base_cap,
        "min_be_share": config.bros_min_be_share,
        "token_group": config.bros_token_group,
        "be_fills_rt_ends": config.bros_be_fills_rt_ends,
        "be_order": config.bros_be_order,
    }


def cost_model_at_start(
    config: EngineConfig, source, needs_profile: bool, target: Callable[[], ProfileTarget]
) -> Planned | None:
    """The step-time model the engine starts with and the record of where it came from
    (engine/profile_cache.py): a given file for every policy (the scheduler's SLO placement
    reads it from the worker's telemetry), else, for a policy that needs one, the on-disk cache
    (keyed by the model's files, `source`) or a fresh profile of `target()`; None otherwise."""
    if config.cost_model_path:
        return profile_cache.given_profile(config.cost_model_path, config)
    if not needs_profile:
        return None
    if source is None:  # a built-in architecture has no files to key a cached profile on
        return profile_cache.fresh_profile(target())
    return profile_cache.cached_profile(target(), source)
