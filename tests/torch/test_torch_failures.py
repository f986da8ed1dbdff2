"""Failures end in a RuntimeError naming who went silent, in bounded time: never a hang."""

from __future__ import annotations

import re
import time

import pytest
import torch_procs as tp

TIMEOUT_S = 5.0  # the process group's timeout: the switchml operation timeout

pytestmark = pytest.mark.slow  # every test spawns a process group


def _dead_rank_run(mode, timeout_s=TIMEOUT_S, env=None, bound_s=None):
    world, die_rank, die_step = 3, 2, 3
    bound_s = timeout_s + 5 if bound_s is None else bound_s
    with tp.Procs(deadline_s=60) as procs:
        procs.start_ranks(tp.dying_rank_body, world, mode, die_rank, die_step, timeout_s,
                          env=env)
        results = procs.results([0, 1])
        procs.join(20)
        codes = [p.exitcode for p in procs.procs]
    for rank in (0, 1):
        res = results[rank]
        assert res["error"] is not None, f"rank {rank} finished training without its peer"
        assert res["step"] == die_step, res
        assert res["seconds"] < bound_s, res
        assert re.search(rf"rank\(s\) \[{die_rank}\]", res["error"]), res["error"]
    # rank 0 crashed (os._exit) after the failure and rank 2 died mid-training: the embedded
    # switch must not survive its owner even without atexit.
    assert codes[0] == 3 and codes[2] == 0, codes
    assert procs.leftover_switches == []
    assert procs.leftover == []


@pytest.mark.timeout(90)
def test_dead_rank_fails_the_others_naming_it():
    """Gradients averaged with dist.all_reduce; rank 2 dies before step 3's all-reduce."""
    _dead_rank_run("manual")


@pytest.mark.timeout(90)
def test_dead_rank_under_ddp_fails_the_others_naming_it():
    _dead_rank_run("ddp", timeout_s=3.0)


@pytest.mark.timeout(90)
def test_dead_rank_with_torchs_default_timeout_fails_within_the_member_timeout():
    """The process group's timeout is torch's default, 30 minutes: the survivors fail once
    the switch has heard nothing from the dead rank for its member timeout (4 s here),
    naming it, not after 30 minutes."""
    _dead_rank_run("ddp", timeout_s=1800.0, env={"SWITCHML_MEMBER_TIMEOUT_S": "4"},
                   bound_s=4 + 15)  # (slack for a loaded machine; 30 minutes without)


@pytest.mark.timeout(90)
def test_dead_switch_fails_the_ranks_naming_it():
    world = 2
    with tp.Procs(deadline_s=75) as procs:
        switch_proc = procs.start(tp.switch_server_body, procs.q)
        kind, address, pid = procs.get(timeout=30)
        assert kind == "switch" and pid == switch_proc.pid
        where = f"{address[0]}:{address[1]}"
        procs.start_ranks(tp.switch_loss_body, world, TIMEOUT_S,
                          env={"SWITCHML_SWITCH": where})
        started = set()
        while len(started) < world:  # every rank has completed ops through the switch
            msg = procs.get(timeout=45)
            assert msg[0] == "progress", msg
            started.add(msg[1])
        switch_proc.kill()
        killed_at = time.time()
        results = procs.results(world, timeout=TIMEOUT_S + 20)
    for rank, res in results.items():
        assert res["switch"] == where, res
        assert res["error"] is not None, f"rank {rank} never noticed the switch was gone"
        assert res["ok_ops"] >= 5, res
        assert res["when"] - killed_at < TIMEOUT_S + 5, res
        assert res["seconds"] < TIMEOUT_S + 5, res
        assert "switch" in res["error"] and where in res["error"], res["error"]
    assert procs.leftover_switches == []
    assert procs.leftover == []


@pytest.mark.timeout(90)
def test_ranks_that_all_reduce_different_sizes_get_an_error_at_once():
    """A script bug (one rank's tensor has another size) is an immediate error on every rank
    saying the ranks disagree, not a timeout and not a wrong sum."""
    world, timeout_s = 3, 30.0
    with tp.Procs(deadline_s=60) as procs:
        procs.start_ranks(tp.mismatch_body, world, timeout_s)
        results = procs.results(world)
    for rank, res in results.items():
        assert res["error"] is not None, f"rank {rank} completed a mismatched all-reduce"
        assert "the ranks disagree" in res["error"], res["error"]
        assert res["seconds"] < 5.0, res  # far below the 30 s process-group timeout
    assert "rank(s) [1]" in results[0]["error"] and "rank(s) [1]" in results[2]["error"]


@pytest.mark.timeout(90)
def test_a_then_callback_may_wait_for_another_collective():
    """torch runs a future's then-callbacks on the thread that completes it; if that were the
    worker's I/O thread, waiting there for another collective would deadlock for good."""
    world = 2
    with tp.Procs(deadline_s=60) as procs:
        procs.start_ranks(tp.nested_wait_body, world)
        results = procs.results(world)
    for rank, res in results.items():
        assert res["error"] is None, (rank, res)
        assert res["seconds"] < 5.0, (rank, res)
        assert res["y"] == [2.0] * 8, (rank, res)
        assert res["threads"] and not res["threads"][0].startswith("switchml-worker"), res


@pytest.mark.timeout(90)
def test_init_with_no_switch_at_the_address_fails_clearly_and_leaves_nothing_running():
    port = tp.free_port()  # nothing listens there (UDP)
    where = f"127.0.0.1:{port}"
    with tp.Procs(deadline_s=60) as procs:
        procs.start_ranks(tp.bad_switch_body, 2, env={"SWITCHML_SWITCH": where})
        results = procs.results(2)
    for rank, res in results.items():
        assert res["error"] is not None, f"rank {rank} initialised without a switch"
        assert where in res["error"] and "JOIN" in res["error"], res["error"]
        assert res["seconds"] < 3.0 + 10, res
        assert not [t for t in res["threads"] if t.startswith("switchml-")], res["threads"]


@pytest.mark.timeout(90)
def test_a_stalled_collective_is_logged_recorded_and_dumped_on_a_signal():
    """What a user sees when a rank stalls: the watchdog's line naming the collective, its
    size and the rank the switch waits for; the flight records (pending, then done); and the
    records dumped as JSON lines on SIGUSR1."""
    import json
    with tp.Procs(deadline_s=60) as procs:
        procs.start_ranks(tp.stall_body, 2, env={"SWITCHML_STALL_LOG_S": "2",
                                                 "SWITCHML_FLIGHT_SIGNAL": "USR1"})
        res = procs.results(2)[0]
    assert res["sum"] == 1.0
    waiting = [m for m in res["log"] if "waiting" in m]
    assert waiting, res["log"]
    assert re.search(r"waiting \d+ s in collective #1 all_reduce \(50000 x float32, via "
                     r"switch\).*rank\(s\) \[1\] have not sent chunk", waiting[0]), waiting[0]
    assert [(r["seq"], r["op"], r["state"]) for r in res["during"]] == [
        (0, "all_reduce", "done"), (1, "all_reduce", "pending")]
    assert res["after"][-1]["state"] == "done" and res["after"][-1]["numel"] == 50000
    dumped = [json.loads(line) for line in res["dump"].splitlines()]
    assert {(d["rank"], d["seq"], d["state"]) for d in dumped} >= {(0, 1, "pending")}


def test_a_setting_rank_0_refuses_fails_every_rank_at_once_naming_it():
    """SWITCHML_AUTH_DATA=1 with a quorum is refused when rank 0 sizes the job; the other
    ranks are told so at once, not after the group's timeout."""
    timeout_s = 120.0
    with tp.Procs(60) as procs:
        procs.start_ranks(tp.rank0_refuses_body, 2, timeout_s,
                          env={"SWITCHML_AUTH_DATA": "1", "SWITCHML_QUORUM": "1"})
        results = procs.results(2, timeout=60)
    assert "auth_data with a quorum" in results[0]["error"]
    assert "rank 0 could not size the group's switch job" in results[1]["error"]
    assert "auth_data with a quorum" in results[1]["error"]
    assert max(results[r]["took_s"] for r in (0, 1)) < timeout_s / 4


def test_a_group_with_auth_data_runs_an_authenticated_job_through_its_embedded_switch():
    """SWITCHML_AUTH_DATA=1: the default group's job carries a MAC on every request and
    result (its chunks leave room for it: 354 int32 at MTU 1500), through the switch rank 0
    embeds (it has a secret), and sums as without it: float and int32, by hand."""
    with tp.Procs(60) as procs:
        procs.start_ranks(tp.auth_data_body, 2, env={"SWITCHML_AUTH_DATA": "1",
                                                     "SWITCHML_MTU": "1500"})
        results = procs.results(2, timeout=60)
    for r in (0, 1):
        got = results[r]
        assert got["auth"] is True and got["k"] == 354 and got["bad_mac"] == 0
        assert got["x"] == [0.0, 3.0, 6.0, 9.0] and got["x_last"] == 4999.0 * 3
        assert got["y"] == [3, 3, 3]


@pytest.mark.timeout(90)
def test_ranks_with_a_tenants_key_make_their_groups_job_in_its_range():
    """SWITCHML_TENANT and SWITCHML_TENANT_KEY: the group's job id is drawn from the tenant's
    range and its ranks prove it with the tenant's key, never the switch's secret (which they
    do not hold); the sum is right."""
    from switchml.protocol.auth import tenant_key, tenant_of
    secret = b"a shared switch's secret, 32 b.."
    with tp.Procs(deadline_s=75) as procs:
        switch_proc = procs.start(tp.switch_server_body, procs.q, 0, secret)
        kind, address, _pid = procs.get(timeout=30)
        assert kind == "switch"
        env = {"SWITCHML_SWITCH": f"{address[0]}:{address[1]}", "SWITCHML_TENANT": "5",
               "SWITCHML_TENANT_KEY": tenant_key(secret, 5).hex()}
        procs.start_ranks(tp.tenant_body, 2, env=env)
        results = procs.results(2, timeout=60)
        switch_proc.kill()  # (it would sleep on, and the harness wait for it)
    assert [results[r]["sum"] for r in (0, 1)] == [[3.0] * 3] * 2  # 1 + 2, by hand
    assert results[0]["job"] == results[1]["job"] and tenant_of(results[0]["job"]) == 5
