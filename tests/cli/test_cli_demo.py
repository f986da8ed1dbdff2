"""``switchml demo`` (``cli/demo.py``): the config it builds and the table it prints."""

from __future__ import annotations

from types import SimpleNamespace

from switchml import demo as library
from switchml.cli import demo, main


def test_flags_become_the_demo_config(parse):
    args = parse("demo")
    assert args.func is demo.run
    assert demo.config_from_args(args) == library.DemoConfig()
    cfg = demo.config_from_args(parse("demo", "-n", "2", "--epochs", "1", "--batch-size", "8",
                                      "--lr", "0.1", "--out", "o", "--backend", "gloo"))
    assert cfg == library.DemoConfig(workers=2, epochs=1, batch_size=8, lr=0.1, out_dir="o",
                                     backends=("gloo",))


def test_the_runner_trains_with_that_config_and_prints_a_row_per_backend(record, capsys):
    result = SimpleNamespace(backend="gloo", steps=12, mean_step_s=0.0125, samples_per_s=2560.0,
                             final_loss=0.25, test_accuracy=0.9, backend_stats=None)
    run_demo = record(library, "run_demo", [result])
    assert main(["demo", "--backend", "gloo", "--workers", "2", "--epochs", "1"]) == 0
    cfg, on_progress = run_demo.args
    assert (cfg.workers, cfg.epochs, cfg.backends) == (2, 1, ("gloo",)) and callable(on_progress)
    captured = capsys.readouterr()
    assert "12.5" in captured.out and "90.0%" in captured.out and "2560" in captured.out
    assert "compiling switchml's kernels" not in captured.err  # gloo alone compiles nothing


def test_a_bad_backend_is_refused(parse, capsys):
    import pytest
    with pytest.raises(SystemExit):
        parse("demo", "--backend", "nccl")
    assert "invalid choice: 'nccl'" in capsys.readouterr().err
