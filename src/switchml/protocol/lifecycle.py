"""The worker's life cycle as one table: ``(state, input) -> next state``.

Every state change of a :class:`~switchml.protocol.worker.WorkerEndpoint` goes through
:func:`next_state`, which looks the pair up in :data:`TRANSITIONS`. A user command whose pair is
missing raises :class:`~switchml.protocol.errors.LocalProtocolError` in one format, "can't X in
state Y", and changes nothing; a peer's message whose pair is missing is dropped and counted by
the worker (it is a late or stray answer). docs/protocol.md's transition table is
:func:`markdown_table`'s output, checked by ``tests/protocol/test_tables.py``.

One hand-written exception, in ``WorkerEndpoint.close``: closing a worker that is closing or
closed does nothing (``close`` is idempotent).
"""

from __future__ import annotations

from enum import Enum

from switchml.protocol.errors import LocalProtocolError

__all__ = ["TRANSITIONS", "WorkerInput", "WorkerState", "can", "markdown_table", "next_state"]


class WorkerState(Enum):
    """Where a worker is in its job."""

    NEW = "new"
    """Created; nothing sent."""
    JOINING = "joining"
    """JOIN sent (to every shard), retried until every shard answered."""
    READY = "ready"
    """Joined; no operation in flight (keep-alives renew the job's lease)."""
    BUSY = "busy"
    """An operation is in flight."""
    REJOINING = "rejoining"
    """Busy, but the switch lost the job: joining again before restarting the operation."""
    CLOSING = "closing"
    """LEAVE sent, retried briefly."""
    CLOSED = "closed"
    """Left; every call but ``close`` fails."""
    ERROR = "error"
    """The job failed (join refused, an operation failed): its slot state can no longer be
    trusted, so a new job must be joined. Only ``close`` is allowed."""


class WorkerInput(Enum):
    """What moves a worker: user commands, and what the switch (or a timer) says."""

    JOIN = "join"
    """User: join the job."""
    START = "start an operation"
    """User: start an all-reduce."""
    CLOSE = "close"
    """User: leave the job."""
    CHALLENGED = "be challenged"
    """Switch: CHALLENGE, the cookie a JOIN must be proven with (answered in place)."""
    JOINED = "be granted the job"
    """Switch: JOINED, from every shard, with the job's geometry."""
    JOIN_FAILED = "fail to join"
    """Switch: REFUSED, a grant that does not match the spec, or no answer in time."""
    SWITCH_LOST_JOB = "learn the switch lost the job"
    """Switch: UNKNOWN_JOB for our operation (busy) or our keep-alive (idle)."""
    COMPLETE = "complete the operation"
    """Switch: the operation's last result."""
    FAIL = "fail the operation"
    """No progress for ``op_timeout_s``, the ranks disagree, or too many restarts."""
    LEFT = "be released"
    """Switch: LEFT from every shard (or the LEAVE timeout passed)."""


_S, _I = WorkerState, WorkerInput
TRANSITIONS: dict[tuple[WorkerState, WorkerInput], WorkerState] = {
    (_S.NEW, _I.JOIN): _S.JOINING,
    (_S.JOINING, _I.CHALLENGED): _S.JOINING,  # answered with the proven JOIN
    (_S.JOINING, _I.JOINED): _S.READY,
    (_S.JOINING, _I.JOIN_FAILED): _S.ERROR,
    (_S.READY, _I.START): _S.BUSY,
    (_S.READY, _I.SWITCH_LOST_JOB): _S.JOINING,  # idle: join the new epoch, then go on
    (_S.BUSY, _I.COMPLETE): _S.READY,
    (_S.BUSY, _I.FAIL): _S.ERROR,
    (_S.BUSY, _I.SWITCH_LOST_JOB): _S.REJOINING,
    (_S.REJOINING, _I.CHALLENGED): _S.REJOINING,
    (_S.REJOINING, _I.JOINED): _S.BUSY,  # the operation restarts from its input
    (_S.REJOINING, _I.JOIN_FAILED): _S.ERROR,  # reported as the operation's failure
    (_S.REJOINING, _I.FAIL): _S.ERROR,
    (_S.NEW, _I.CLOSE): _S.CLOSED,  # nothing to leave
    (_S.JOINING, _I.CLOSE): _S.CLOSING,
    (_S.READY, _I.CLOSE): _S.CLOSING,
    (_S.BUSY, _I.CLOSE): _S.CLOSING,  # the operation in flight fails (aborted)
    (_S.REJOINING, _I.CLOSE): _S.CLOSING,
    (_S.ERROR, _I.CLOSE): _S.CLOSING,
    (_S.CLOSING, _I.LEFT): _S.CLOSED,
}
"""Every legal ``(state, input)`` and the state it leads to."""


def next_state(state: WorkerState, what: WorkerInput, detail: str = "") -> WorkerState:
    """The state ``what`` leads to from ``state``.

    Raises:
        LocalProtocolError: "can't <what> in state <state>" (plus ``detail``), when the table
            has no such transition.
    """
    new = TRANSITIONS.get((state, what))
    if new is None:
        raise LocalProtocolError(f"can't {what.value} in state {state.value}"
                                 + (f": {detail}" if detail else ""))
    return new


def can(state: WorkerState, what: WorkerInput) -> bool:
    """Whether the table has ``(state, what)``."""
    return (state, what) in TRANSITIONS


def markdown_table() -> str:
    """The transition table as Markdown (docs/protocol.md shows exactly this)."""
    rows = ["| state | input | next state |", "|---|---|---|"]
    rows += [f"| {s.value} | {i.value} | {n.value} |" for (s, i), n in TRANSITIONS.items()]
    return "\n".join(rows) + "\n"
