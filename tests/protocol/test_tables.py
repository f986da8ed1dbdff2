"""The state tables: complete, consistent, and printed in docs/protocol.md as they are.

Run ``python tests/protocol/test_tables.py`` to rewrite the docs' copies after changing a table.
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

from switchml.protocol import lifecycle, slots
from switchml.protocol.errors import LocalProtocolError
from switchml.protocol.lifecycle import TRANSITIONS, WorkerInput, WorkerState, next_state
from switchml.protocol.slots import Round, SlotAction, action_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
BLOCKS = {"slot-rules": slots.markdown_table, "worker-states": lifecycle.markdown_table}


def _block(text: str, name: str) -> str:
    m = re.search(rf"<!-- begin {name}[^>]*-->\n(.*?)<!-- end {name} -->", text, re.S)
    assert m is not None, f"docs/protocol.md has no {name} block"
    return m.group(1)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_docs_print_the_tables_as_they_are(name):
    assert _block(DOC.read_text(), name) == BLOCKS[name](), (
        "docs/protocol.md is out of date: run python tests/protocol/test_tables.py")


def test_every_slot_situation_has_exactly_one_action():
    table = action_table()
    assert table.shape == (2, 3, 2, 2, 2) and (table >= 0).all()
    # Spot checks of the rules the protocol rests on, in jobs with and without a quorum.
    for q, older in ((0, SlotAction.DROP_STALE), (1, SlotAction.ANSWER_OLD)):
        assert {table[q, Round.OLDER, c, d, a]
                for c, d, a in itertools.product((0, 1), repeat=3)} == {older}
        assert {table[q, Round.NEWER, c, d, a]
                for c, d, a in itertools.product((0, 1), repeat=3)} == {SlotAction.START_ROUND}
        assert table[q, Round.SAME, 1, 1, 1] == SlotAction.RESEND_RESULT
        assert table[q, Round.SAME, 0, 0, 1] == SlotAction.ADD
        assert table[q, Round.SAME, 0, 0, 0] == SlotAction.REFUSE_MISMATCH
    # A first contribution to a complete round: a late duplicate where every rank is in
    # (dropped); a rank left out of a quorum round gets the result.
    assert {table[0, Round.SAME, 0, 1, a] for a in (0, 1)} == {SlotAction.DROP_LATE}
    assert {table[1, Round.SAME, 0, 1, a] for a in (0, 1)} == {SlotAction.ANSWER_LATE}


def test_an_ambiguous_or_missing_slot_rule_is_refused(monkeypatch):
    rules = slots.SLOT_RULES
    monkeypatch.setattr(slots, "SLOT_RULES", rules[:-1])  # no rule for an agreeing add
    with pytest.raises(ValueError, match="0 slot rules match SAME"):
        action_table()
    monkeypatch.setattr(slots, "SLOT_RULES", rules + (rules[0],))
    with pytest.raises(ValueError, match="2 slot rules match OLDER"):
        action_table()


def test_every_state_is_reachable_and_every_input_used():
    reached = {WorkerState.NEW}
    frontier = [WorkerState.NEW]
    while frontier:
        state = frontier.pop()
        for (s, _), new in TRANSITIONS.items():
            if s is state and new not in reached:
                reached.add(new)
                frontier.append(new)
    assert reached == set(WorkerState)
    assert {i for _, i in TRANSITIONS} == set(WorkerInput)


@pytest.mark.parametrize("state", list(WorkerState))
def test_a_missing_transition_raises_one_message_format(state):
    for what in WorkerInput:
        if (state, what) in TRANSITIONS:
            assert next_state(state, what) is TRANSITIONS[state, what]
        else:
            with pytest.raises(LocalProtocolError,
                               match=f"^can't {re.escape(what.value)} in state {state.value}"):
                next_state(state, what)


if __name__ == "__main__":
    text = DOC.read_text()
    for name, render in BLOCKS.items():
        text = text.replace(_block(text, name), render())
    DOC.write_text(text)
    print(f"rewrote the tables in {DOC}", file=sys.stderr)
