"""``switchml predict`` (``cli/predict.py``): profile, then one prediction per system."""

from __future__ import annotations

import json
from types import SimpleNamespace

from switchml import predict as library
from switchml.cli import main, predict


def _prediction(system: str, speedup: float) -> SimpleNamespace:
    return SimpleNamespace(system=system, step_s=0.1 / speedup, comm_s=0.05, exposed_s=0.02,
                           comm_share=0.5, speedup=speedup,
                           bound_by="switch CPU" if system == "switchml" else "wire")


def test_profile_and_predict_get_the_flags(record, parse, capsys):
    assert parse("predict").func is predict.run
    prof = SimpleNamespace(params=1000, batch=8, compute_s=0.05, buckets=[1, 2], colocated=2,
                           slowdown=1.5)
    profile = record(library, "profile", prof)
    preds = record(library, "predict", [_prediction("gloo", 1.0),
                                        _prediction("switchml", 1.5)])
    assert main(["predict", "--model", "cnn", "--batch", "8", "-n", "8", "--rate-mbit", "100",
                 "--mtu", "9000", "--colocated", "2", "--steps", "3", "--threads", "2",
                 "--shards", "3"]) == 0
    assert profile.args == ("cnn", 8) and profile.kwargs == {"steps": 3, "colocated": 2}
    res = preds.kwargs.pop("res")
    assert preds.args == (prof,) and preds.kwargs == {"workers": 8, "rate_bps": 100e6,
                                                      "mtu": 9000}
    assert (res.threads, res.shards) == (2, 3)
    out = capsys.readouterr().out
    assert "switchml helps: switchml 1.50x gloo's step" in out
    row = next(ln for ln in out.splitlines() if "│ switchml" in ln or "switchml │" in ln)
    assert row.rstrip(" │").endswith("switch CPU")  # the resource that binds each row


def test_little_to_gain_is_said_too(record, capsys):
    record(library, "profile", SimpleNamespace(params=1, batch=1, compute_s=1.0, buckets=[],
                                               colocated=1, slowdown=1.0))
    record(library, "predict", [_prediction("gloo", 1.0), _prediction("switchml", 1.01)])
    assert main(["predict"]) == 0
    assert "little to gain: communication is only 50% of gloo's step" in capsys.readouterr().out


def test_json_holds_the_profile_and_every_prediction(record, tmp_path):
    record(library, "profile", SimpleNamespace(params=1000, batch=8, compute_s=0.05,
                                               buckets=[1], colocated=1, slowdown=1.0))
    record(library, "predict", [_prediction("gloo", 1.0), _prediction("switchml", 1.5)])
    record(library, "profile_dict", {"params": 1000})
    path = tmp_path / "predict.json"
    assert main(["predict", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["profile"] == {"params": 1000}
    assert [(p["system"], p["speedup"], p["comm_share"]) for p in data["predictions"]] == [
        ("gloo", 1.0, 0.5), ("switchml", 1.5, 0.5)]


def test_against_predicts_every_row_of_a_run_beside_its_measurement(record, tmp_path, capsys):
    rows = [{"model": "ncf", "system": "switchml", "workers": 4, "rate_bps": 1e9,
             "step_s": 0.1}]
    run = tmp_path / "train.json"
    run.write_text(json.dumps({"results": rows}))
    checked = [{"model": "ncf", "system": "switchml", "workers": 4, "rate_bps": 1e9,
                "measured_step_s": 0.1, "predicted_step_s": 0.11, "error": 0.1}]
    validate = record(library, "validate", checked)
    path = tmp_path / "against.json"
    assert main(["predict", "--against", str(run), "--json", str(path)]) == 0
    assert validate.args == (rows,)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "ncf" in ln)
    cells = [c.strip() for c in line.strip("│ ").split("│")]
    assert cells == ["ncf", "switchml", "4", "1000", "100", "110", "+10%"]
    assert json.loads(path.read_text()) == {"against": str(run), "rows": checked}
