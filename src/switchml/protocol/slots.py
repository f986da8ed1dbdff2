"""The switch's per-(slot, set) rule as one table: what a REQUEST does to the round it names.

A REQUEST names a slot ``s``, a set ``v`` and a round key ``(seq, chunk)``. What the switch does
depends on whether the job is a quorum job (created with ``JobSpec.quorum``: a round completes
when ``k`` of the ``n`` ranks are in) and on four facts about ``(s, v)`` (SwitchML, NSDI'21
section 4; ``switch.py`` explains why one set bit is enough): how the request's round compares
with the set's, whether the rank has already contributed to it, whether the round is complete,
and whether the chunk agrees with the round's shape (size, element type, exponent, flags,
operation digest). :data:`SLOT_RULES`
lists every case once; :func:`action_table` turns it into the array the compiled kernel looks
actions up in (``kernels.switch_requests``), and docs/protocol.md shows :func:`markdown_table`'s
output (checked by ``tests/protocol/test_tables.py``).
"""

from __future__ import annotations

import itertools
from enum import IntEnum

import numpy as np

__all__ = ["SLOT_RULES", "Round", "SlotAction", "action_table", "markdown_table"]


class Round(IntEnum):
    """The request's round ``(seq, chunk)`` against the set's (serial-number order for seq)."""

    OLDER = 0
    SAME = 1
    NEWER = 2


class SlotAction(IntEnum):
    """What the switch does with the request."""

    DROP_STALE = 0
    """A packet of an earlier round or operation: dropped (the original can't tell rounds
    apart; a software switch can)."""
    START_ROUND = 1
    """A new round: the first contributor *overwrites* the accumulator (no explicit reset),
    ``seen = {rank}``, ``missing = n - 1``; the other set keeps its result (the shadow copy)."""
    ADD = 2
    """Add the chunk, OR the flags, max the look-ahead exponent; the last contribution
    completes the round and its result goes to every member."""
    RESEND_RESULT = 3
    """A retransmission into a complete round: the rank lost the result; it gets a unicast
    copy (``RESENT`` flag)."""
    ANSWER_WAITING = 4
    """A retransmission into an open round: its data is in; it gets WAITING, naming the ranks
    still missing (MISMATCH instead, if some rank's chunk was refused)."""
    DROP_LATE = 5
    """A first contribution to a complete round: a late duplicate from a rank that has moved
    on (its bit was cleared by its packet to the other set): dropped."""
    REFUSE_MISMATCH = 6
    """The chunk disagrees with the round: refused; the rank and the round's contributors get
    MISMATCH (the operation can never complete)."""
    ANSWER_OLD = 8
    """Quorum jobs: a request of an earlier round than the set's: a rank the quorum left
    behind. A retransmission (``RETRY``) is answered with that round's result if the slot's
    history still holds it (``SwitchConfig.quorum_history``), else with GONE (its result is
    gone: the rank's operation fails at once, ``RoundGone``); a first transmission is dropped
    as stale (the round's multicast reached the rank)."""
    ANSWER_LATE = 7
    """Quorum jobs: a first contribution to a round that completed without it. Not added. A
    retransmission (``RETRY``: the rank lost the round's multicast) gets the stored result (a
    unicast copy, ``RESENT`` flag, with the bitmap of the ranks it holds, which lacks this
    one); a first transmission is dropped, since the multicast reaches the rank anyway. The
    rank goes on with the same result as everyone else."""


ANY = None
"""A fact the action does not depend on."""

SLOT_RULES: tuple[tuple[bool | None, Round, bool | None, bool | None, bool | None, SlotAction],
                  ...] = (
    # quorum job  round       contributed  complete  agrees  -> action
    (False, Round.OLDER, ANY, ANY, ANY, SlotAction.DROP_STALE),
    (True, Round.OLDER, ANY, ANY, ANY, SlotAction.ANSWER_OLD),
    (ANY, Round.NEWER, ANY, ANY, ANY, SlotAction.START_ROUND),
    (ANY, Round.SAME, True, True, ANY, SlotAction.RESEND_RESULT),
    (ANY, Round.SAME, True, False, ANY, SlotAction.ANSWER_WAITING),
    (False, Round.SAME, False, True, ANY, SlotAction.DROP_LATE),
    (True, Round.SAME, False, True, ANY, SlotAction.ANSWER_LATE),
    (ANY, Round.SAME, False, False, False, SlotAction.REFUSE_MISMATCH),
    (ANY, Round.SAME, False, False, True, SlotAction.ADD),
)
"""``(quorum job, round, rank already contributed, round complete, chunk agrees) -> action``;
``ANY`` where the action does not depend on the fact. Every combination matches exactly one
rule. (In a job without a quorum a complete round holds every rank, so a first contribution
to it can only be a late duplicate; in a quorum job it is a rank the round completed
without.)"""


def action_table() -> np.ndarray:
    """``SLOT_RULES`` as an int64 array indexed ``[quorum, round, contributed, complete,
    agrees]``.

    Raises:
        ValueError: a combination matches no rule, or more than one.
    """
    table = np.full((2, 3, 2, 2, 2), -1, np.int64)
    for quorum, rnd, contributed, complete, agrees in itertools.product(
            (False, True), Round, *[(False, True)] * 3):
        facts = (contributed, complete, agrees)
        hits = [a for q, r, *want, a in SLOT_RULES
                if r is rnd and (q is ANY or q == quorum)
                and all(w is ANY or w == f for w, f in zip(want, facts))]
        if len(hits) != 1:
            raise ValueError(f"{len(hits)} slot rules match {rnd.name}, quorum={quorum}, "
                             f"contributed={contributed}, complete={complete}, agrees={agrees}")
        table[int(quorum), rnd, int(contributed), int(complete), int(agrees)] = hits[0]
    return table


def markdown_table() -> str:
    """The rules as Markdown (docs/protocol.md shows exactly this)."""

    def cell(v: bool | None) -> str:
        return "any" if v is ANY else ("yes" if v else "no")

    rows = ["| quorum job | round | rank already in | round complete | chunk agrees | action |",
            "|---|---|---|---|---|---|"]
    rows += [f"| {cell(q)} | {r.name.lower()} | {cell(c)} | {cell(d)} | {cell(a)} | "
             f"{act.name.lower().replace('_', ' ')} |" for q, r, c, d, a, act in SLOT_RULES]
    return "\n".join(rows) + "\n"
