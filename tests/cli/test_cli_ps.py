"""``switchml ps server`` and ``switchml ps train`` (``cli/ps.py``)."""

from __future__ import annotations

import pytest

from switchml import links
from switchml.cli import main, ps
from switchml.ps import launch
from switchml.ps.launch import PSRunConfig
from switchml.ps.server import ServerConfig


def test_server_flags_become_the_server_config(parse):
    args = parse("ps", "server", "--index", "1", "-n", "3", "-b", "1", "--mode", "async",
                 "--optimizer", "adam", "--lr", "0.5", "--momentum", "0", "--timeout-s", "9")
    assert args.func is ps.run_server and (args.index, args.port) == (1, 40000)
    assert ps.server_config_from_args(args) == ServerConfig(3, 1, "async", "adam", 0.5, 0.0,
                                                            9.0)


def test_train_flags_become_the_run_config(parse):
    args = parse("ps", "train")
    assert args.func is ps.run_train
    assert ps.train_config_from_args(args) == PSRunConfig(slow_s=0.05)
    cfg = ps.train_config_from_args(parse(
        "ps", "train", "-p", "3", "-n", "2", "--steps", "5", "--batch", "4", "--model", "cnn",
        "--seed", "7", "--max-shard-elements", "10", "--slow-worker", "1", "--slow-s", "0.5"))
    assert cfg == PSRunConfig(servers=3, workers=2, steps=5, batch=4, model="cnn", seed=7,
                              max_shard_elements=10, slow_worker=1, slow_s=0.5)


def test_train_runs_with_that_config_and_fresh_tls_credentials(record, tmp_path, capsys):
    made = record(links, "make_credentials")
    result = {"placement": "placement table", "test_accuracy": 0.5, "elapsed_s": 1.0,
              "steps_applied": 3, "dropped_late": 0, "iterations": [3, 3], "digest": "abc"}
    run = record(launch, "run_ps_training", result)
    out = tmp_path / "r.json"
    assert main(["ps", "train", "--steps", "3", "--tls", "--json", str(out)]) == 0
    (cfg,) = run.args
    assert cfg.steps == 3 and cfg.tls_dir == f"{made.args[0]}"
    assert made.args[0].endswith("/tls")
    text = capsys.readouterr().out
    assert "placement table" in text and "parameter digest abc" in text
    assert '"digest": "abc"' in out.read_text()


def test_a_bad_mode_is_refused(parse, capsys):
    with pytest.raises(SystemExit):
        parse("ps", "server", "--mode", "lazy")
    assert "invalid choice: 'lazy'" in capsys.readouterr().err
