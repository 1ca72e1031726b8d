"""Paged KV cache: block pool, prefix hashing, per-request block tables, tensor storage."""
from services.worker.engine.kv.block_pool import Block, BlockPool
from services.worker.engine.kv.kv_cache_manager import BlockTable, KVCacheManager
from services.worker.engine.kv.prefix_hash import hash_block
from services.worker.engine.kv.storage import KVCacheStorage, num_blocks_for_budget

__all__ = [
    "Block", "BlockPool", "BlockTable", "KVCacheManager", "KVCacheStorage", "hash_block", "num_blocks_for_budget",
]
