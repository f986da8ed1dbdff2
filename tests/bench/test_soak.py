"""The soak benchmark (``switchml bench soak``): a short run with loss and worker churn."""

from __future__ import annotations

import pytest

from switchml.bench.soak import FuzzConfig, SoakConfig, run_fuzz, run_soak


@pytest.mark.slow
def test_short_soak_has_no_wrong_results_and_returns_every_slot():
    report = run_soak(SoakConfig(duration_s=8.0, jobs=2, workers=2, numel=20_000,
                                 loss_rate=0.02, churn_interval_s=3.0, kill_fraction=1.0,
                                 lease_timeout_s=4.0, op_timeout_s=3.0, seed=1))
    # (A 2 s lease lost both jobs in 2 of 4 fresh-clone CI runs. Likely, not proven: with a
    # keep-alive every 1 s, a 2 s stall of the 2-core machine while a new job's processes
    # start is enough. The
    # switch's lease timer runs on its own thread, and after a stall it can expire a job whose
    # datagrams are still waiting in the socket: a known weakness, docs/operations.md.)
    assert report.operations > 50
    assert report.wrong_results == 0
    assert report.workers_killed >= 1
    assert report.switch_stats["jobs"] == 0 and report.switch_stats["slots_in_use"] == 0
    assert report.switch_stats["internal_errors"] == 0


@pytest.mark.slow
def test_fuzz_run_drops_every_hostile_kind_and_the_job_stays_exact():
    """``switchml bench fuzz``'s library, small: each of the seven hostile kinds 1,000 times
    (the kind is the datagram's index mod 7) at a switch with a secret while a job runs."""
    r = run_fuzz(FuzzConfig(datagrams=7000, senders=1, rate_per_sender=5000.0, seed=3))
    assert r["datagrams_sent"] == 7000
    assert r["internal_errors"] == 0
    assert r["legit_operations"] > 0 and r["legit_wrong_results"] == 0
    drops = r["drops"]
    for reason in ("short", "bad_magic", "length_mismatch", "bad_token", "bad_keepalive"):
        assert drops.get(reason, 0) > 0, (reason, drops)
    assert sum(drops.values()) >= 5000  # nearly everything hostile is dropped and counted
    assert r["jobs_at_end"] == 0  # the JOIN flood created no job (the switch has a secret)
    rss = [m[1] for m in r["memory"]]
    assert max(rss) - rss[0] < 64 * 2**20, rss


@pytest.mark.slow
def test_a_join_flood_is_answered_or_dropped_and_the_job_goes_on_exactly():
    """``bench fuzz --joins``: well-formed JOINs of new jobs, by turns asking for a challenge
    and carrying a forged cookie, at a switch with a secret while a job runs: half draw a
    CHALLENGE, half are dropped (``bad_cookie``), no job is created, the job's results stay
    exact, and the report gives its rate alone and during the flood."""
    r = run_fuzz(FuzzConfig(datagrams=4000, senders=1, rate_per_sender=2000.0, seed=5,
                            joins=True))
    assert r["datagrams_sent"] == 4000 and r["internal_errors"] == 0
    assert r["legit_operations"] > 0 and r["legit_wrong_results"] == 0
    assert r["drops"].get("bad_cookie", 0) >= 1900, r["drops"]  # the forged half, about
    assert r["jobs_at_end"] == 0
    assert r["legit_elements_per_s_alone"] > 0 and r["legit_elements_per_s_during"] > 0
    assert 0 < r["flood_datagrams_per_s"] <= 2000 * 1.2
