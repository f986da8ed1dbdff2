"""``switchml plan`` and ``switchml calibrate`` from the command line."""

from __future__ import annotations

import json

import pytest

from switchml.cli import main
from switchml.costs import Costs, load


def test_plan_prints_and_writes_a_row_per_rate(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    Costs(0, 6e-9, 0, 4e-9, 2e-9, source="by hand").save(cal)
    out = tmp_path / "plan.json"
    assert main(["plan", "-n", "4", "--rate-gbit", "10", "--rate-gbit", "25", "--size", "8MiB",
                 "--calibration", str(cal), "--json", str(out)]) == 0
    plans = json.loads(out.read_text())["plans"]
    assert [p["rate_bps"] for p in plans] == [10e9, 25e9]
    assert plans[1]["threads"] >= plans[0]["threads"] and plans[1]["shards"] > plans[0]["shards"]
    assert all(p["share"] >= 0.9 and "by hand" in p["costs_source"] for p in plans)
    text = capsys.readouterr().out
    assert "switch shards" in text and "by hand" in text


def test_plan_refuses_a_missing_calibration(tmp_path, capsys):
    assert main(["plan", "--calibration", str(tmp_path / "none.json")]) == 2
    assert "no calibration at" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_measures_this_machine(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--no-gloo", "--out", str(out)]) == 0
    c = load(out)
    # A worker spends something per element (every element is quantised and copied), and a
    # switch per request; nothing takes a millisecond.
    assert 0 < c.worker_element_s < 1e-6 and 0 < c.switch_request_s + c.switch_element_s
    assert max(c.worker_datagram_s, c.switch_request_s) < 1e-3
    assert "measured" in c.source and "reference" in c.source  # gloo: the reference's
    assert str(out) in capsys.readouterr().out
