"""Events the core hands to its driver through ``next_event()``: frozen, past tense."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Event",
    "JobCreated",
    "JobRemoved",
    "Joined",
    "JoinFailed",
    "Left",
    "MemberJoined",
    "OperationCompleted",
    "OperationFailed",
]

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class JobCreated:
    """Switch: the first JOIN of a job allocated its slots."""

    job_id: int
    num_workers: int
    slot_base: int
    window: int
    elements_per_packet: int


@dataclass(frozen=True, slots=True)
class MemberJoined:
    """Switch: a rank joined (or re-joined from a new address)."""

    job_id: int
    rank: int
    address: Address


@dataclass(frozen=True, slots=True)
class JobRemoved:
    """Switch: every member left; the slots went back to the pool."""

    job_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class Joined:
    """Worker: the switch accepted our JOIN; operations may start."""

    slot_base: int
    window: int


@dataclass(frozen=True, slots=True)
class JoinFailed:
    """Worker: the switch refused the JOIN, or did not answer in time."""

    reason: str


@dataclass(frozen=True, slots=True)
class OperationCompleted:
    """Worker: every chunk of operation ``seq`` was received; the output is final."""

    seq: int


@dataclass(frozen=True, slots=True)
class OperationFailed:
    """Worker: operation ``seq`` cannot complete; ``reason`` names who stopped answering."""

    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class Left:
    """Worker: LEAVE was acknowledged (or given up on); the endpoint is closed."""


Event = (JobCreated | MemberJoined | JobRemoved | Joined | JoinFailed | OperationCompleted
         | OperationFailed | Left)
