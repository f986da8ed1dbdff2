"""``switchml bench allreduce``: size arguments, and a small run against gloo."""

from __future__ import annotations

import json
import time

import pytest

from switchml.bench.allreduce import BenchConfig, parse_size, run_benchmark


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


def test_a_sharded_benchmark_switch_serves_a_rank_on_every_shard():
    # Two shards, a rank on two threads: its lanes stripe over both, and the sum is right (the
    # worker checks against n(n+1)/2 times its base vector, computed apart from the protocol).
    cfg = BenchConfig(workers=1, sizes_bytes=(1 << 20,), iters=2, warmup=1, shards=2, threads=2,
                      baselines=(), timeout_s=120)
    results, stats = run_benchmark(cfg)
    (row,) = results
    assert row.max_rel_error is not None and row.max_rel_error < 1e-6
    assert [s["packets_in"] > 0 for s in stats["shards"]] == [True, True]
    # the shards' CPU, summed, over the worker's timed loop: a share of at most two cores
    assert 0 < row.extra["switch_cpu_percent"] <= 200 + 10


def test_a_worker_that_fails_before_the_timed_loop_ends_the_benchmark_at_once():
    # The failing rank breaks the start barrier: the others and the parent stop waiting for it
    # (they waited the whole timeout before).
    cfg = BenchConfig(workers=2, sizes_bytes=(1 << 20,), iters=1, warmup=0, baselines=(),
                      switch=(("no-such-host.invalid", 9),), timeout_s=120)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker failed: ConfigError: can.t resolve the switch "
                                           "host .no-such-host.invalid."):
        run_benchmark(cfg)
    assert time.monotonic() - t0 < cfg.timeout_s / 4
