"""A replica dies mid-training and a replacement joins the running job
(``switchml.torch.live``): the others never wait for it, the replacement starts from a live
rank's model and optimizer state and position, contributes from then on, and every replica
ends with the same parameters, bit for bit. Each fails on a switch that refuses a rank joining
a running job (before live membership, every job did)."""

from __future__ import annotations

import datetime
import time

import live_procs
import pytest
import torch_procs as tp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]  # process groups

WORLD, STEPS, DIE_STEP = 4, 140, 60


def test_a_replacement_joins_the_running_job_with_the_live_state():
    """Four replicas (quorum 3) train; rank 3 dies at step 60. A first replacement starts
    without ``LiveQuorum.warm_up``: its DDP holds its first step's buckets in parameter order,
    the live replicas theirs in gradient order, of the same size, so that summed, elements
    would be other parameters' gradients; the hook refuses it, naming the remedy, and it
    exits. A second, with ``warm_up``, joins and finishes the run. Ranks 1 and 2, which paused
    early on, catch up: one from a live rank's state, the other from the sums it was sent,
    neither computing the steps it missed."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    final: dict[int, tuple[str, object]] = {}
    with tp.Procs(deadline_s=120) as procs:
        switch_proc = procs.start(tp.switch_server_body, procs.q, 0)
        kind, address, _pid = procs.get(timeout=30)
        assert kind == "switch"
        switch = f"{address[0]}:{address[1]}"
        for r in range(WORLD):
            procs.start(live_procs.replica_main, procs.q, r, WORLD, store.port, switch, STEPS,
                        DIE_STEP if r == 3 else None, False, 0.05)
        for warm_up in (False, True):
            msg = procs.get(timeout=60)
            while msg[0] == "progress" or msg[0] == "result":
                final[msg[1]] = (msg[0], msg[2]) if msg[0] == "result" else final.get(msg[1])
                msg = procs.get(timeout=60)
            assert msg[1] == 3 and msg[0] == ("error" if warm_up else "died"), msg
            if warm_up:
                assert "live.warm_up" in msg[2], msg  # the first replacement's refusal
            procs.start(live_procs.replica_main, procs.q, 3, WORLD, store.port, switch, STEPS,
                        None, True, 0.0, warm_up)
        while len([r for r in final if final[r]]) < WORLD:
            msg = procs.get(timeout=90)
            if msg[0] in ("result", "error"):
                final[msg[1]] = (msg[0], msg[2])
        switch_proc.kill()  # (it would sleep on, and the harness wait for it)
    assert all(kind == "result" for kind, _ in final.values()), final
    res = {r: v for r, (_, v) in final.items()}
    new = res[3]
    assert DIE_STEP < new["start_step"] < STEPS  # it started from the live state, mid-run
    assert new["stats"]["joined_after_s"] < 20.0  # (the state came within the timeout)
    for r in range(WORLD):
        assert res[r]["params"].tobytes() == res[0]["params"].tobytes(), r
    for r in (0, 1, 2):
        assert max(res[r]["step_s"]) < 2.0, res[r]["step_s"]  # nobody waited for rank 3
    # Rank 1 paused early on, fell more than 10 steps behind, and took a live rank's state
    # (skipping the steps between) rather than compute its way back; rank 2, a few steps
    # behind, took those steps' sums without computing them (how many depends on how far
    # the others got meanwhile: with rank 3's replacement still catching up, the quorum of
    # three waits for rank 2 too; one step, or two, in runs here).
    assert res[1]["stats"]["caught_up"] >= 1 and res[1]["skipped"] > 10, res[1]["stats"]
    assert res[2]["not_computed"] >= 1 and res[2]["stats"]["caught_up"] == 0, res[2]["stats"]
    # (the two replacements' requests and the catch-ups; the first replacement may have
    # caught up too before it failed, and reports nothing)
    assert sum(res[r]["stats"]["states_served"] for r in (0, 1, 2)) >= 2 + sum(
        res[r]["stats"]["caught_up"] for r in range(WORLD))
    # It contributed: once caught up (the others sleep before each step; it does not), its
    # chunks open the rounds.
    assert new["stats"]["results_left_out"] < new["stats"]["results_received"] / 2, new["stats"]


def test_a_live_job_goes_on_over_gloo_when_its_switch_dies_and_back_when_it_returns():
    """Three replicas (quorum 2) with ``failover="gloo"``; rank 2 dies at step 4 and its
    replacement joins with the live state (its operations numbered from the live rank's
    position). Once all three passed step 15, the switch is killed: within the timeout the
    replicas agree who is alive, hand over the last results some lacked, and go on over a
    gloo group of their own. A new switch comes up at the same address two seconds after
    the switch-over; the first of them opens a fresh job there, and all go back to it. Ten
    steps later the replacement dies too, and a second replacement joins the fresh job (its
    spec, the failover's epoch and numbering from the store). Every replica finishes with the
    same parameters, bit for bit, and no step waited much longer than the timeout. (Before,
    every replica's all-reduce failed when the switch died.)"""
    import numpy as np
    import torch.distributed as dist
    world, steps, timeout_s = 3, 200, 3.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    final: dict[int, tuple[str, object]] = {}
    with tp.Procs(deadline_s=150) as procs:
        port = tp.free_port()
        switch_proc = procs.start(tp.switch_server_body, procs.q, port)
        kind, address, _pid = procs.get(timeout=30)
        assert kind == "switch"
        switch = f"{address[0]}:{address[1]}"

        def replica(r, die_step=None, replacement=False, die_after_back=None):
            procs.start(live_procs.failover_replica_main, procs.q, r, world, store.port,
                        switch, steps, die_step, replacement, 15, timeout_s, die_after_back)

        for r in range(world):
            replica(r, die_step=4 if r == 2 else None)
        reported: set[int] = set()
        deaths = 0
        while len(final) < world:
            msg = procs.get(timeout=90)
            if msg[0] == "died":
                deaths += 1  # the first replacement dies after the switch's return
                replica(2, replacement=True, die_after_back=10 if deaths == 1 else None)
            elif msg[0] == "progress":
                reported.add(msg[1])
                if len(reported) == world:
                    switch_proc.kill()
                    time.sleep(timeout_s + 2.0)  # (the replicas are on gloo by then)
                    second = procs.start(tp.switch_server_body, procs.q, port)
                    kind, again, _pid = procs.get(timeout=30)
                    assert kind == "switch" and tuple(again) == tuple(address), again
            else:
                final[msg[1]] = (msg[0], msg[2])
        second.kill()
    assert all(kind == "result" for kind, _ in final.values()), final
    assert deaths == 2
    res = {r: v for r, (_, v) in final.items()}
    for r in (0, 1):
        fo = res[r]["stats"]["failover"]
        assert fo["switch_overs"] == 1 and fo["switch_backs"] == 1, fo
        assert not fo["active"] and fo["error"] is None and fo["ops_over_gloo"] > 0, fo
        assert max(res[r]["step_s"]) < timeout_s + 3, res[r]["step_s"]
        assert res[r]["back_at"] is not None and res[r]["back_at"] < steps - 30
    new = res[2]  # the second replacement: it joined the fresh job, after the way back
    assert new["start_step"] > res[0]["back_at"], (new["start_step"], res[0]["back_at"])
    assert new["stats"]["failover"].get("switch_overs", 0) == 0
    assert new["stats"]["results_left_out"] < new["stats"]["results_received"], new["stats"]
    for r in range(world):
        assert np.array_equal(res[r]["params"], res[0]["params"]), r
        # the same numbers for the same all-reduces: the replacements numbered theirs from
        # the live rank's position, in the fresh job from the store's offset
        assert res[r]["stats"]["failover"]["numbered"] == res[0]["stats"]["failover"][
            "numbered"], (r, res[r]["stats"]["failover"])
