"""Paged KV cache: block pool, prefix hashing, per-request block tables, the KV manager's core
and its components, tensor storage."""

from engine.kv.block_pool import Block, BlockPool
from engine.kv.block_table import BlockTable, HostEntry
from engine.kv.component import KVComponent
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.ledger import KVLedger
from engine.kv.partial import PartialResidency
from engine.kv.prefix_hash import hash_block
from engine.kv.storage import KVCacheStorage, num_blocks_for_budget
from engine.kv.two_ended import TwoEndedBlocks

__all__ = [
    "Block",
    "BlockPool",
    "BlockTable",
    "HostEntry",
    "KVCacheManager",
    "KVCacheStorage",
    "KVComponent",
    "KVLedger",
    "PartialResidency",
    "TwoEndedBlocks",
    "hash_block",
    "num_blocks_for_budget",
]
