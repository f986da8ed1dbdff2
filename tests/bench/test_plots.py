"""Benchmark plots from result files (no root)."""

from __future__ import annotations

import json

from switchml.bench.plots import plot_results


def _row(system, n, size, ate, loss=0.0, rate=1e9):
    line = rate / 32
    return {"system": system, "workers": n, "size_bytes": size, "ate_per_s": ate,
            "loss_rate": loss, "rate_bps": rate, "bound_line_ate": line,
            "bound_ring_ate": line / (2 * (n - 1) / n)}


def test_plots_are_written_for_what_the_rows_support(tmp_path):
    rows = [_row(s, 4, size, ate) for size in (2**16, 2**20, 2**24)
            for s, ate in (("switchml", 3e7), ("gloo", 2e7), ("ps", 3e6))]
    rows += [_row(s, n, 2**24, ate) for n in (2, 8) for s, ate in (("switchml", 3e7),
                                                                  ("gloo", 2e7))]
    rows += [_row(s, 4, 2**24, ate, loss=loss) for loss in (0.001, 0.01)
             for s, ate in (("switchml", 2e7), ("gloo", 1.9e7))]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": rows}))
    written = plot_results([str(path)], str(tmp_path / "out"))
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["ate_vs_size.png", "slowdown_vs_loss.png", "speedup_vs_n.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_plot_without_data(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [_row("switchml", 4, 2**20, 1e7)]}))
    assert plot_results([str(path)], str(tmp_path / "out")) == []


def test_loss_slowdown_is_against_the_loss_free_run_at_the_same_mtu():
    from switchml.bench.plots import loss_slowdowns
    rows = []
    for mtu, base in ((9000, 3e7), (1500, 2e7)):  # the jumbo baseline comes first
        r = _row("switchml", 4, 2**24, base)
        r["mtu"] = mtu
        rows.append(r)
    lossy = _row("switchml", 4, 2**24, 1e7, loss=0.01)
    lossy["mtu"] = 1500
    rows.append(lossy)
    key, series = loss_slowdowns(rows)
    assert key[3] == 1500
    assert series == {"switchml": [(0.01, 2.0)]}  # 2e7 / 1e7, not 3e7 / 1e7
