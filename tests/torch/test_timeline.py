"""The training timeline (``switchml.torch.timeline``): hidden fraction and Chrome trace events."""

from __future__ import annotations

import pytest

from switchml.torch.timeline import Timeline, chrome_events, hidden_fraction


def test_hidden_fraction_is_the_overlap_of_unions():
    # comm [0,4] and [3,6] -> union [0,6]; compute [2,5] -> overlap 3 of 6
    assert hidden_fraction([(0, 4), (3, 6)], [(2, 5)]) == pytest.approx(0.5)
    assert hidden_fraction([(0, 1)], [(1, 2)]) == 0.0
    assert hidden_fraction([(1, 2)], [(0, 3)]) == 1.0
    assert hidden_fraction([(0, 2), (4, 6)], [(1, 5)]) == pytest.approx(0.5)
    assert hidden_fraction([], [(0, 1)]) is None


def test_chrome_events_are_complete_events_in_microseconds():
    tl = Timeline()
    tl.record("backward", "compute", 10.0, 10.5)
    tl.record("allreduce bucket 0", "comm", 10.25, 10.75, bytes=4)
    ev = chrome_events(tl.snapshot(), pid=3, origin_s=10.0, process_name="rank 3")
    xs = [e for e in ev if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["pid"]) for e in xs] == [
        ("backward", 0.0, 500000.0, 3), ("allreduce bucket 0", 250000.0, 500000.0, 3)]
    assert {e["args"]["name"] for e in ev if e["name"] == "thread_name"} == {"compute", "comm"}
    with pytest.raises(ValueError, match="tid must be"):
        tl.record("x", "gpu", 0, 1)
