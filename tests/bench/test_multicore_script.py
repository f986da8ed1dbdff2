"""``docs/results/multicore/run.sh``, the script a lent many-core machine runs (docs/benchmarks.md
§6 cites its figures): its CI group, small, so that it still works when a machine is lent."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_multicore_script_runs_its_smoke_group(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    res = subprocess.run(["bash", "docs/results/multicore/run.sh", str(tmp_path), "small",
                          "smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert res.returncode == 0, res.stderr
    steps = [line for line in res.stdout.splitlines() if line.strip().startswith("rc=")]
    assert len(steps) == 3 and all(s.strip().startswith("rc=0 ") for s in steps), res.stdout
    with tarfile.open(tmp_path / "multicore.tgz") as tar:
        tar.extractall(tmp_path / "out", filter="data")
    for threads in (1, 2):
        doc = json.loads((tmp_path / "out" / f"smoke-T{threads}-S2.json").read_text())
        (row,) = doc["results"]
        assert row["max_rel_error"] is not None and row["max_rel_error"] < 1e-6
        assert doc["config"]["shards"] == 2 and doc["config"]["threads"] == threads
        assert [s["packets_in"] > 0 for s in doc["switch_stats"]["shards"]] == [True, True]
