"""``switchml bench plot`` (``cli/bench/plot.py``)."""

from __future__ import annotations

import pytest

from switchml.bench import plots
from switchml.cli import main
from switchml.cli.bench import plot


def test_it_plots_the_files_and_prints_each_png(record, parse, capsys):
    assert parse("bench", "plot", "a.json").func is plot.run
    drawn = record(plots, "plot_results", ["out/ate.png", "out/speedup.png"])
    assert main(["bench", "plot", "a.json", "b.json", "--out", "out"]) == 0
    assert drawn.args == (["a.json", "b.json"], "out")
    assert capsys.readouterr().out.split() == ["out/ate.png", "out/speedup.png"]


def test_it_needs_a_file(parse, capsys):
    with pytest.raises(SystemExit):
        parse("bench", "plot")
    assert "the following arguments are required: files" in capsys.readouterr().err
