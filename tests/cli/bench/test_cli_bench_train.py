"""``switchml bench train`` (``cli/bench/train.py``): the config, the runner's call and outputs."""

from __future__ import annotations

import csv
import json

import pytest

from switchml.bench import testbed_train as library
from switchml.bench.testbed_train import TrainBenchConfig
from switchml.cli import main
from switchml.cli.bench import train


def test_flags_become_the_train_config(parse):
    args = parse("bench", "train")
    assert args.func is train.run
    assert train.config_from_args(args) == TrainBenchConfig()
    cfg = train.config_from_args(parse(
        "bench", "train", "-n", "8", "--model", "cnn", "--model", "mlp", "--steps", "5",
        "--batch", "16", "--eval-every", "0", "--systems", "gloo,hybrid", "--trace", "t.json",
        "--rate-mbit", "250", "--loss", "0.01", "--mtu", "9000"))
    assert cfg == TrainBenchConfig(workers=8, models=("cnn", "mlp"), steps=5, batch=16,
                                   eval_every=0, systems=("gloo", "hybrid"), trace=True,
                                   rate_bps=250e6, loss_rate=0.01, mtu=9000)


def test_an_unknown_workload_is_refused(parse, capsys):
    with pytest.raises(SystemExit):
        parse("bench", "train", "--model", "gpt5")
    assert "invalid choice: 'gpt5'" in capsys.readouterr().err


def _row(system: str) -> dict:
    return {"model": "cnn", "params": 1000, "system": system, "step_s": 0.1,
            "samples_per_s": 320.0, "final_loss": 0.5, "speedup_step": 1.0,
            "trace_events": [1, 2], "decisions": ["layer 1: aggregate"] if system == "hybrid"
            else []}


def test_the_runner_writes_json_and_csv_without_trace_events(record, tmp_path, capsys):
    run = record(library, "run_testbed_train", [_row("gloo"), _row("hybrid")])
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    assert main(["bench", "train", "--model", "cnn", "--systems", "gloo,hybrid", "--json",
                 str(out_json), "--csv", str(out_csv)]) == 0
    (cfg,) = run.args
    assert cfg.models == ("cnn",) and cfg.systems == ("gloo", "hybrid")
    doc = json.loads(out_json.read_text())
    assert doc["benchmark"] == "train-testbed" and doc["config"]["models"] == ["cnn"]
    assert all("trace_events" not in r for r in doc["results"])
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["system"] for r in rows] == ["gloo", "hybrid"] and rows[0]["step_s"] == "0.1"
    captured = capsys.readouterr()
    assert "cnn hybrid: layer 1: aggregate" in captured.err and "320" in captured.out
