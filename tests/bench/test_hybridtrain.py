"""Trace merging, byte counters and configuration of the hybrid training bench."""

from __future__ import annotations

import json

import pytest

from switchml.bench.hybridtrain import link_bytes, wrap
from switchml.bench.testbed import TrainBenchConfig, write_trace
from switchml.torch.timeline import Span, chrome_events


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
