"""Events the core hands to its driver through ``next_event()``: frozen, past tense."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from switchml.protocol.address import Address

__all__ = [
    "Event",
    "JobCreated",
    "JobRefused",
    "JobRemoved",
    "Joined",
    "JoinFailed",
    "Left",
    "MemberJoined",
    "OperationCompleted",
    "OperationAborted",
    "OperationRestarted",
]



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
class JobRefused:
    """Switch: a JOIN was refused (no room, bad geometry, missing secret, taken rank)."""

    job_id: int
    rank: int
    address: Address
    reason: str


@dataclass(frozen=True, slots=True)
class JobRemoved:
    """Switch: the job is gone and its slots went back to the pool; ``reason`` says why
    (``"left"``: every member left; a lease that expired; an operator's removal)."""

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
    contributors: Any = field(default=None, compare=False)
    """In a quorum job (``JobSpec.quorum``), how many ranks each block's sum holds (an int64
    array: block ``b`` is elements ``b * block`` up to ``(b + 1) * block``); None in a job
    without a quorum, where every sum holds every rank."""
    block: int = field(default=0, compare=False)
    """The elements of a block (``contributors``)."""


@dataclass(frozen=True, slots=True)
class OperationAborted:
    """Worker: operation ``seq`` cannot complete and was given up; ``reason`` names who stopped
    answering (or what disagreed). A driver fails the operation's handle with the exception
    :class:`~switchml.protocol.errors.OperationFailed` and this reason
    (:class:`~switchml.protocol.errors.SwitchUnreachable` when ``switch_silent``,
    :class:`~switchml.protocol.errors.RanksDisagree` when ``disagree``,
    :class:`~switchml.protocol.errors.RoundGone` when ``gone``)."""

    seq: int
    reason: str
    switch_silent: bool = False
    """No datagram at all came from the switch while the operation waited its timeout out."""
    disagree: bool = False
    """The switch said the ranks issued different operations (MISMATCH)."""
    gone: bool = False
    """The switch said a round this rank waits for is past its history (GONE)."""


@dataclass(frozen=True, slots=True)
class OperationRestarted:
    """Worker: the switch lost the job (restart, expired lease); the operation starts over from
    its input on a new epoch, as ``new_seq``."""

    seq: int
    new_seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class Left:
    """Worker: LEAVE was acknowledged (or given up on); the endpoint is closed."""


Event = (JobCreated | MemberJoined | JobRefused | JobRemoved | Joined | JoinFailed
         | OperationCompleted | OperationAborted | OperationRestarted | Left)
