"""``switchml bench allreduce``: size arguments, and a small run against gloo."""

from __future__ import annotations

import json

import pytest

from switchml.bench.allreduce import parse_size


@pytest.mark.parametrize("text,value", [("64MiB", 64 * 2**20), ("1k", 1000), ("4096", 4096),
                                        ("1.5KiB", 1536), ("2GB", 2 * 10**9)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "3", "12 parsecs", "-4KiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.slow
def test_bench_allreduce_small_run_writes_json(tmp_path, run_switchml):
    path = tmp_path / "bench.json"
    res = run_switchml("bench", "allreduce", "--workers", "2", "--size", "256KiB", "--iters", "2",
               "--warmup", "1", "--json", str(path), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "switchml/gloo" in res.stdout
    doc = json.loads(path.read_text())
    systems = {m["system"]: m for m in doc["results"]}
    assert set(systems) == {"switchml", "gloo"}
    sm = systems["switchml"]
    assert sm["numel"] == 65536 and sm["ate_per_s"] > 0
    assert sm["max_rel_error"] is not None and sm["max_rel_error"] < 1e-6
    assert len(sm["cpu_percent"]) == 2
    assert systems["gloo"]["ate_per_s"] > 0
