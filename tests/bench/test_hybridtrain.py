"""Timeline, hidden fraction, trace merging and byte counters of the hybrid training bench."""

from __future__ import annotations

import json

import pytest

from switchml.bench.hybridtrain import link_bytes, wrap
from switchml.bench.testbed import TrainBenchConfig, write_trace
from switchml.torch.timeline import Span, Timeline, chrome_events, hidden_fraction


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


def test_write_trace_merges_runs_and_names_processes(tmp_path):
    rows = [{"model": "mlp", "system": s, "trace_events": chrome_events(
        [Span("forward", "compute", start, start + 0.5)], pid=0, origin_s=0.0)}
        for s, start in (("switchml", 100.0), ("hybrid", 200.0))]
    path = tmp_path / "t.json"
    write_trace(rows, str(path))
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["pid"] for e in xs) == [0, 100]
    assert all(e["ts"] == 0.0 for e in xs)  # each run from its own first event
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"mlp switchml rank 0", "mlp hybrid rank 0"}


def test_link_bytes_reads_this_namespace():
    assert link_bytes("lo") >= 0
    with pytest.raises(ValueError, match="no interface"):
        link_bytes("nonexistent0")


def test_config_and_wrap_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown system"):
        TrainBenchConfig(systems=("gloo", "nccl"))
    with pytest.raises(ValueError, match="unknown model"):
        TrainBenchConfig(models=("resnet",))
    with pytest.raises(ValueError, match="--batch"):
        TrainBenchConfig(batch=0)
    with pytest.raises(ValueError, match="unknown mode"):
        wrap(None, "fsdp", None)
