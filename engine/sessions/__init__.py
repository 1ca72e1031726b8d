"""Multi-turn sessions: kept KV across device, host and disk tiers (Symphony). See docs/sessions.md."""

from engine.sessions.costs import TransferCosts
from engine.sessions.eviction import EvictionCandidate, EvictionPolicy, make_eviction_policy
from engine.sessions.kvfile import KVFormatError, KVHeader, KVLayout, verify_file
from engine.sessions.records import PrefetchResult, SessionInfo, SessionStats
from engine.sessions.store import SessionStore

__all__ = [
    "EvictionCandidate",
    "EvictionPolicy",
    "KVFormatError",
    "KVHeader",
    "KVLayout",
    "PrefetchResult",
    "SessionInfo",
    "SessionStats",
    "SessionStore",
    "TransferCosts",
    "make_eviction_policy",
    "verify_file",
]
