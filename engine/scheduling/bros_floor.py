"""The minimum BE share on memory (`BEFloor`): which BE requests RT may not evict, and how
many device blocks new RT admissions must leave for BE.

Why (issue 20, measured in the fair simulator at ShareGPT 3 req/s, docs/bros.md "Rate 3"):
the share on step *tokens* alone did not keep batch work moving once RT's decodes held the
memory. An owed BE request got its chunk, RT growth pushed it to host the next step (BE first,
as the paper's victim order says), host space filled, and from then on every eviction dropped
its KV: BE computed ~500 tokens/s and threw ~500 tokens/s away, with 18 BE requests waiting on
host and 4 of 825 blocks on device. A share of compute is worth nothing without the memory to
keep what it computed, so the floor guarantees memory as well, at admission:

- The floor is `min_be_share x device blocks`. The BE requests at the front of the BE order
  that *cover* it (whole KV, prompt + `max_tokens`, up to and including the request that
  reaches the floor) are *protected*: an RT request may not evict them (only the last-resort
  head, when nothing else could run, may). Until session 11 only the requests that fit inside
  the floor were protected: with ~53-block BE requests and an 83-block floor that was one
  request, 6.4% of the pool, and RT at ShareGPT 3 req/s kept BE near it (docs/bros.md,
  "Eighth pass"). A minimum is met by rounding up, not down.
- `deficit` is what those requests still need on device (admitted ones their restore and
  growth; an unadmitted one whole if it heads the BE order, else the `chunk` it needs to
  start), at most what the protected set holds short of covering the floor: a new RT request
  is admitted only if it leaves that many blocks free. The requests that complete the floor
  get a start, not their whole KV reserved: reserving them whole kept ~30 blocks idle while
  RT waited (RT 2.6x slower at ShareGPT 3 req/s for BE +35%). *Every* unadmitted request of
  the floor gets its start, not only the first (session 12): the reservation covers the same
  requests as the protection, whichever of them happen to hold KV. With a first-only rule
  the reservation shrank to one request exactly when BE held least, when the head of the BE
  order and the request after it were both unadmitted (a batch transition, or the head
  parked after RT growth took its blocks): the second then got nothing reserved and RT
  admissions took the free blocks before it could start (ShareGPT 3 req/s seed 0: BE −15.1%
  with the first-only rule, −7.5% with this one; docs/bros.md, "Twelfth session"). Admitted RT requests keep
  running and growing; new ones wait until finishing RT requests return the memory (the same
  rule as for parked RT requests). That is what a batch user promised a share expects: the
  share is reserved at the door, not taken back from requests already running. While BE holds
  its share of the pool anywhere the deficit is 0 (at ShareGPT 2 req/s BE holds ~3x the
  floor): holding RT back there cost RT TTFT and gave BE nothing.

The first request of the BE order is always inside the floor (a floor smaller than one
request would otherwise guarantee nothing). With plenty of memory BE holds far more than the
floor and the protected requests are the last BE victims anyway, so nothing changes there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling.request import Request


@dataclass(frozen=True)
class BEFloor:
    """One step's floor: `protected` BE requests (RT may not evict them) and `deficit`, the
    device blocks new RT admissions leave free for them."""

    protected: frozenset[Request] = field(default_factory=frozenset)
    deficit: int = 0

    @classmethod
    def of(cls, kv: KVCacheManager, be_order: list[Request], share: float, chunk: int = 0) -> BEFloor:
        """The floor for `be_order` (BE requests, running and waiting, in packing order) at
        `share` of the device pool (0: no floor). `chunk`: tokens an unadmitted request other
        than the head of `be_order` needs to start (0: its whole KV)."""
        floor = math.ceil(share * kv.pool.num_blocks)
        if floor <= 0:
            return cls()
        protected: list[Request] = []
        wanted = need = 0
        for b in be_order:
            if wanted >= floor:
                break
            whole = -(-(b.num_prompt_tokens + b.params.max_tokens) // kv.block_size)
            if kv.holds(b):
                protected.append(b)
                need += max(0, whole - kv.device_blocks(b))
            else:
                need += whole if not wanted or not chunk else min(whole, -(-chunk // kv.block_size))
            wanted += whole
        # BE holding its share elsewhere owes RT nothing: RT growth evicts the BE requests
        # behind the floor first, and that memory goes to the front ones
        all_held = sum(kv.device_blocks(b) for b in be_order if kv.holds(b))
        return cls(frozenset(protected), max(0, min(need, max(floor, wanted) - all_held)))
