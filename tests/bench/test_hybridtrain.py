"""Trace merging, byte counters and configuration of the hybrid training bench."""

from __future__ import annotations

import json

import pytest

from switchml.bench.hybridtrain import link_bytes, wrap
from switchml.bench.testbed_train import (
    TrainBenchConfig,
    add_ideal,
    add_time_to_target,
    write_trace,
)
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
    with pytest.raises(ValueError, match="unknown workload 'resnet'"):
        TrainBenchConfig(models=("resnet",))
    with pytest.raises(ValueError, match="TrainBenchConfig.batch"):
        TrainBenchConfig(batch=0)
    with pytest.raises(ValueError, match="TrainBenchConfig.kill_switch_at must be a step in 1..59"):
        TrainBenchConfig(kill_switch_at=60)
    with pytest.raises(ValueError, match="switchml would fail once the switch is gone"):
        TrainBenchConfig(systems=("gloo", "switchml"), kill_switch_at=5)
    TrainBenchConfig(systems=("gloo", "switchml-failover"), kill_switch_at=5)  # fine
    with pytest.raises(ValueError, match="switch_back_after_s needs TrainBenchConfig.kill_sw"):
        TrainBenchConfig(switch_back_after_s=5.0)
    with pytest.raises(ValueError, match="kill_worker_at must be a step in 1..59"):
        TrainBenchConfig(systems=("switchml-live",), kill_worker_at=60)
    with pytest.raises(ValueError, match="replace_after_s >= 0"):
        TrainBenchConfig(systems=("switchml-live",), kill_worker_at=5, replace_after_s=-1)
    with pytest.raises(ValueError, match="switchml-live and torchft"):
        TrainBenchConfig(systems=("gloo", "switchml-quorum"), kill_worker_at=5)
    TrainBenchConfig(systems=("switchml-live", "torchft"), kill_worker_at=5)  # fine
    with pytest.raises(ValueError, match="catch_up_steps must be >= 0"):
        TrainBenchConfig(catch_up_steps=-1)
    with pytest.raises(ValueError, match="unknown mode"):
        wrap(None, "fsdp", None)


def test_around_the_replacement_reads_the_runs_reports():
    """Hand-made reports of two live ranks and a replacement: rank 2 died at step 3 (wall
    10.0), its replacement started at 11.0; the live ranks' steps after the death include one
    of 1.5 s; the replacement's first step ended at 14.0 with none of its data, its second
    (15.0) with some."""
    from switchml.bench.testbed_live import around_the_replacement
    cfg = TrainBenchConfig(systems=("switchml-live",), kill_worker_at=3, workers=3)
    live = {"times": [0.5, 1.0, 1.5, 2.0, 3.5, 4.0], "walls": [7.5, 8, 8.5, 9, 10.5, 11],
            "params_digest": "a", "live": {"states_served": 1}}
    other = {**live, "live": {"states_served": 0}}
    new = {"walls": [14.0, 15.0, 16.0], "mine": [0, 3, 7], "start_step": 4,
           "params_digest": "a", "live": {"joined_after_s": 0.8, "results_left_out": 4,
                                          "results_received": 10}}
    r = around_the_replacement(cfg, [live, other, new], {"died_wall": 10.0,
                                                         "started_wall": 11.0})
    assert r["before_kill_step_s"] == 0.5 and r["kill_stall_s"] == 1.5  # (steps 2 and 3: 0.5)
    assert r["after_kill_step_s"] == 1.0  # the median of 1.5, 0.5, 1.5, 0.5
    assert r["replacement_first_step_s"] == 3.0 and r["replacement_contributes_s"] == 4.0
    assert r["replacement_contributed"] == 0.6 and r["replacement_state_s"] == 0.8
    assert r["replicas_identical"] and r["states_served"] == 1
    new["params_digest"] = "b"
    assert not around_the_replacement(cfg, [live, other, new], {
        "died_wall": 10.0, "started_wall": 11.0})["replicas_identical"]


def test_plot_steps_marks_the_faults(tmp_path):
    from switchml.bench.testbed_live import plot_steps
    rows = [{"model": "ncf", "system": "switchml-live", "workers": 3, "rate_bps": 1e9,
             "times": [0.5, 1.0, 2.5, 3.0], "kill_worker_at": 2, "replacement_start_step": 3},
            {"model": "ncf", "system": "torchft", "workers": 3, "rate_bps": 1e9,
             "times": [0.7, 1.4, 2.1, 2.8]}]
    path = tmp_path / "steps.png"
    plot_steps(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(system, step_s, **kw):
    return {"model": "ncf", "system": system, "step_s": step_s, "rate_bps": 1e9,
            "losses": [1.0] * 5, "times": [1.0] * 5, **kw}


def test_the_ideal_is_compute_plus_the_exposed_wire_time():
    # C = 100 ms (noop); gloo moved 100 MB per step both ways (50 MB each way: 0.4 s at
    # 1 Gbit/s) with 25% hidden: ideal 0.1 + 0.75 x 0.4 = 0.4 s, achieved 0.4 / 0.5.
    rows = [_row("noop", 0.1), _row("gloo", 0.5, bytes_per_step_measured=100e6,
                                    hidden_fraction=0.25),
            _row("switchml", 0.3, bytes_per_step_measured=50e6)]
    add_ideal(rows)
    assert "ideal_step_s" not in rows[0]
    assert rows[1]["ideal_step_s"] == pytest.approx(0.4)
    assert rows[1]["achieved_over_ideal"] == pytest.approx(0.8)
    assert rows[2]["ideal_step_s"] == pytest.approx(0.1 + 0.2)  # nothing hidden
    assert "ideal_lockstep_step_s" not in rows[1]  # no lockstep row in this run
    without_noop = [_row("gloo", 0.5, bytes_per_step_measured=1e6)]
    add_ideal(without_noop)
    assert "ideal_step_s" not in without_noop[0]


def test_the_lockstep_ideal_starts_from_the_slowest_ranks_compute():
    # noop 100 ms, lockstep 120 ms (the ranks waited for each other); gloo as above: its
    # lockstep ideal is 0.12 + 0.75 x 0.4 = 0.42 s, achieved 0.42 / 0.5; the noop ideal stays
    # 0.4 s. Neither reference row gets an ideal of its own.
    rows = [_row("noop", 0.1), _row("lockstep", 0.12, bytes_per_step_measured=2e3),
            _row("gloo", 0.5, bytes_per_step_measured=100e6, hidden_fraction=0.25)]
    add_ideal(rows)
    assert rows[2]["ideal_step_s"] == pytest.approx(0.4)
    assert rows[2]["ideal_lockstep_step_s"] == pytest.approx(0.42)
    assert rows[2]["achieved_over_lockstep_ideal"] == pytest.approx(0.84)
    assert rows[2]["lockstep_step_s"] == 0.12
    assert not any(k.startswith(("ideal", "achieved")) for r in rows[:2] for k in r)


def test_time_to_target_metric_is_the_first_evaluation_at_the_level_all_reached():
    # perplexity (lower is better): gloo ends at 120, switchml at 110; the target is 120,
    # which switchml reached at its second evaluation (t = 2 s), gloo at its last (t = 9 s);
    # noop (no aggregation) does not set the target.
    rows = [_row("gloo", 0.5, evals=[(10, 3.0, 300.0), (20, 9.0, 120.0)]),
            _row("switchml", 0.25, evals=[(10, 1.0, 200.0), (20, 2.0, 115.0),
                                          (30, 4.0, 110.0)]),
            _row("noop", 0.1, evals=[(10, 0.5, 500.0)]),
            _row("lockstep", 0.1, evals=[(10, 0.5, 600.0)])]
    for r in rows:
        r["model"] = "lstm"
        r["final_metric"] = r["evals"][-1][2]
    add_time_to_target(rows)
    assert [r["target_metric"] for r in rows] == [120.0] * 4
    assert [r["time_to_metric_s"] for r in rows] == [9.0, 2.0, None, None]
    assert rows[1]["speedup_step"] == pytest.approx(2.0)
