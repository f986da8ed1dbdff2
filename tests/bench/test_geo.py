"""``switchml bench geo`` without root: configuration, comparison and outputs; with root, a
short real run on the geo testbed."""

from __future__ import annotations

import csv
import json

import pytest

from switchml.bench.geo import (
    GeoBenchConfig,
    _compare,
    _mean_row,
    run_geo_bench,
    time_to_target,
    write_outputs,
)


def _row(mode, times, accs, wan_bytes):
    return {"mode": mode, "dcs": [2, 2], "wan_bps": 50e6, "steps": 10, "elapsed_s": times[-1],
            "times": times, "accuracy": accs, "final_accuracy": accs[-1],
            "last_accuracy": accs[-1],
            "wan_bytes": wan_bytes}


def test_config_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown mode"):
        GeoBenchConfig(modes=("lan", "fast"))
    with pytest.raises(ValueError, match="two data centres"):
        GeoBenchConfig(dcs=(4,))
    with pytest.raises(ValueError, match="accuracy in"):
        GeoBenchConfig(target_accuracy=95)
    with pytest.raises(ValueError, match="inner-steps"):
        GeoBenchConfig(inner_steps=0)
    with pytest.raises(ValueError, match="outer-bits"):
        GeoBenchConfig(outer_bits=8)


def test_a_modes_row_is_the_mean_of_its_seeds():
    runs = [{**_row("gaia", [1, 2], [0.9, 0.96], 100), "seed": 0, "time_to_target_s": 2,
             "final_loss": 0.2},
            {**_row("gaia", [1, 3], [0.8, 0.98], 300), "seed": 1, "time_to_target_s": 3,
             "final_loss": 0.4}]
    row = _mean_row(runs)
    assert (row["wan_bytes"], row["time_to_target_s"]) == (200, 2.5)
    assert row["final_accuracy"] == pytest.approx(0.97)
    assert row["final_loss"] == pytest.approx(0.3)
    assert row["times"] == [1, 2] and [r["seed"] for r in row["runs"]] == [0, 1]
    runs[1]["time_to_target_s"] = None  # one seed never reached it: the mean has no time
    assert _mean_row(runs)["time_to_target_s"] is None


def test_comparison_and_outputs(tmp_path):
    rows = [_row("lan", [1, 2, 3], [0.5, 0.96, 0.97], 0),
            _row("wan", [5, 10, 15], [0.5, 0.9, 0.97], 1000),
            _row("gaia", [1.5, 2.5, 3.5], [0.5, 0.95, 0.965], 50)]
    for r in rows:
        r["time_to_target_s"] = time_to_target(r, 0.95)
    assert [r["time_to_target_s"] for r in rows] == [2, 15, 2.5]
    _compare(rows)
    gaia = rows[2]["comparison"]
    assert gaia["time_to_target_vs_lan"] == pytest.approx(1.25)
    assert gaia["speedup_vs_wan"] == pytest.approx(6.0)
    assert gaia["wan_bytes_vs_wan"] == pytest.approx(0.05)
    assert gaia["accuracy_minus_wan_points"] == pytest.approx(-0.5)
    paths = write_outputs(rows, GeoBenchConfig(), str(tmp_path))
    doc = json.loads(open(paths[0]).read())
    assert doc["benchmark"] == "geo" and len(doc["results"]) == 3
    table = list(csv.DictReader(open(paths[1])))
    assert table[2]["mode"] == "gaia" and float(table[2]["speedup_vs_wan"]) == 6.0
    assert open(paths[2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.root
@pytest.mark.slow
def test_short_geo_run_on_the_testbed():
    cfg = GeoBenchConfig(modes=("wan", "gaia", "diloco"), steps=12, eval_every=4, model="mlp",
                         wan_bps=20e6, target_accuracy=0.3, inner_steps=4)
    rows = run_geo_bench(cfg)
    wan, gaia, diloco = rows
    assert wan["wan_bytes"] > 12 * 19210 * 4  # a dense all-reduce crossed every step
    assert gaia["wan_bytes"] < wan["wan_bytes"]
    assert gaia["eval_steps"][-1] == 12 and 0 < gaia["final_accuracy"] <= 1
    assert len(gaia["gaia"]) == 2  # both data centre leaders reported
    # DiLoCo: three outer steps of 19,210 parameters, 16-bit, through the switch: data
    # centre 1's leader sends its pseudo-gradient over the WAN and gets the sum back
    assert [d["outer_steps"] for d in diloco["diloco"]] == [3, 3]
    assert 3 * 19210 * 2 * 2 < diloco["wan_bytes"] < wan["wan_bytes"] / 3
    assert 0 < diloco["final_accuracy"] <= 1
