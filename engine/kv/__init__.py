"""Paged KV cache: block pool, prefix hashing, per-request block tables, tensor storage."""

from engine.kv.block_pool import Block, BlockPool
from engine.kv.kv_cache_manager import BlockTable, KVCacheManager
from engine.kv.prefix_hash import hash_block
from engine.kv.storage import KVCacheStorage, num_blocks_for_budget

__all__ = [
    "Block",
    "BlockPool",
    "BlockTable",
    "KVCacheManager",
    "KVCacheStorage",
    "hash_block",
    "num_blocks_for_budget",
]
