"""Request state, the scheduling-policy interface, and the scheduler that drives it."""

from engine.scheduling.policy import (
    BatchLimits,
    ScheduledBatch,
    ScheduledItem,
    SchedulerState,
    SchedulingPolicy,
)
from engine.scheduling.registry import POLICIES, make_policy, policy_class
from engine.scheduling.request import SLO, CacheForm, FinishReason, Request, RequestClass, RequestStatus
from engine.scheduling.scheduler import Scheduler

__all__ = [
    "POLICIES",
    "BatchLimits",
    "CacheForm",
    "FinishReason",
    "Request",
    "RequestClass",
    "RequestStatus",
    "SLO",
    "ScheduledBatch",
    "ScheduledItem",
    "Scheduler",
    "SchedulerState",
    "SchedulingPolicy",
    "make_policy",
    "policy_class",
]
