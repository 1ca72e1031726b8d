"""`leases`: who is the active instance of each doubled service (scheduler, queue, advisory).

One partition, so every reader sees every record in the same order and agrees on each term's
holder: the first `held` record of a term wins it (shared/lease.py has the rules).
"""

from __future__ import annotations

from typing import Literal

from shared.schemas.base import WireModel

LeaseState = Literal["held", "released", "standby"]


class LeaseRecord(WireModel):
    role: str  # scheduler | queue | advisory (the record's key too)
    holder: str  # the instance: its service id, pid and start time (unique per process)
    term: int  # held/released: the term claimed or renewed; standby: the highest term it has read
    # held: a claim (a term above the last) or a renewal (the holder's own term); released: the
    # holder stopped cleanly, so a standby may claim at once; standby: a standby saying it is
    # there (`tandem status` lists both members of a pair; the lease rules ignore it)
    state: LeaseState = "held"
    sent_at: float  # wall clock, for `tandem status` (the rules use the reader's own clock)
    seq: int = 0  # the holder's record counter: a holder times its lease from its own records read back
