"""Switch failover (``SWITCHML_FAILOVER=gloo``, ``torch/failover.py``): a group whose switch is
killed goes on over gloo within its timeout, with exact sums and the same numbers on every
rank; a rank that missed the last results before the switch died takes them from a peer."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch_procs as tp

pytestmark = pytest.mark.slow  # spawns a process group

TIMEOUT_S = 3.0  # the process group's timeout: the switchml operation timeout


class DownstreamCut:
    """A UDP relay between one rank and the switch that can stop passing the switch's
    datagrams to the rank (``cut``): the rank then misses results the others get."""

    def __init__(self, switch: tuple[str, int]) -> None:
        self.switch = switch
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the rank's side
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the switch's side
        self.back.bind(("127.0.0.1", 0))
        for s in (self.front, self.back):
            s.settimeout(0.2)
        self.rank_addr: tuple[str, int] | None = None
        self.cut = False
        self.dropped = 0
        self._stop = False
        self._threads = [threading.Thread(target=self._up, daemon=True),
                         threading.Thread(target=self._down, daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def address(self) -> str:
        host, port = self.front.getsockname()
        return f"{host}:{port}"

    def _up(self) -> None:
        while not self._stop:
            try:
                data, addr = self.front.recvfrom(65536)
            except OSError:
                continue
            self.rank_addr = addr
            self.back.sendto(data, self.switch)

    def _down(self) -> None:
        while not self._stop:
            try:
                data, _ = self.back.recvfrom(65536)
            except OSError:
                continue
            if self.cut:
                self.dropped += 1
            elif self.rank_addr is not None:
                self.front.sendto(data, self.rank_addr)

    def close(self) -> None:
        self._stop = True
        for t in self._threads:
            t.join(2)
        self.front.close()
        self.back.close()


def _run(world: int, ops: int, relay_rank: int | None, back_after_s: float | None = None,
         threads: int = 1, again_after_s: float | None = None):
    """``ops`` checked all-reduces, then DDP; the switch killed once every rank did 5 (with
    ``relay_rank``, that rank's results cut a second before); with ``back_after_s``, a new
    switch at the same address that long after the kill; with ``again_after_s``, that one
    killed too, that long after it started."""
    with tp.Procs(deadline_s=100) as procs:
        port = tp.free_port() if back_after_s is not None else 0
        switch_proc = procs.start(tp.switch_server_body, procs.q, port)
        kind, address, _pid = procs.get(timeout=30)
        assert kind == "switch"
        where = f"{address[0]}:{address[1]}"
        relay = DownstreamCut(tuple(address)) if relay_rank is not None else None
        switch_for = {relay_rank: relay.address} if relay is not None else {}
        env = {"SWITCHML_SWITCH": where, "SWITCHML_FAILOVER": "gloo",
               "SWITCHML_FAILOVER_PROBE_S": "1" if back_after_s is not None else "0",
               "SWITCHML_THREADS": str(threads)}
        try:
            procs.start_ranks(tp.failover_body, world, TIMEOUT_S, ops, switch_for, env=env)
            started = set()
            while len(started) < world:  # every rank has completed ops through the switch
                msg = procs.get(timeout=45)
                assert msg[0] == "progress", msg
                started.add(msg[1])
            if relay is not None:
                relay.cut = True  # the rank misses what the switch sends from now on
                time.sleep(1.0)
            switch_proc.kill()
            if back_after_s is not None:
                time.sleep(back_after_s)
                second = procs.start(tp.switch_server_body, procs.q, port)
                kind, again, _pid = procs.get(timeout=30)
                assert kind == "switch" and tuple(again) == tuple(address), again
                if again_after_s is not None:
                    time.sleep(again_after_s)
                    second.kill()
            res = procs.results(list(range(world)), timeout=60)
        finally:
            if relay is not None:
                relay.close()
    for r in range(world):
        assert all(res[r]["exact"]), (r, res[r]["exact"])  # before, across and after
        fo = res[r]["stats"]["failover"]
        overs = 2 if again_after_s is not None else 1
        assert fo["switch_overs"] == overs and fo["error"] is None, fo
        assert fo["active"] is (back_after_s is None or again_after_s is not None), fo
        # one stall of about the timeout, then gloo: nothing waits much longer than it
        assert max(res[r]["seconds"]) < TIMEOUT_S + 3, res[r]["seconds"]
        for name, value in res[r]["final"].items():  # DDP after the switch-over
            assert np.array_equal(value, res[0]["final"][name]), (r, name)
    return res


@pytest.mark.timeout(150)
@pytest.mark.parametrize("threads", [1, 2], ids=["one-thread", "two-threads"])
def test_a_killed_switch_hands_the_group_over_to_gloo_with_exact_sums(threads):
    """Two threads: a rank's large all-reduces travel in two parts (two jobs), its small ones
    in the first alone; both fail over."""
    world, ops = 3, 40
    res = _run(world, ops, None, threads=threads)
    for r in range(world):
        if threads > 1:  # (the parallel client's counters say how many it drives)
            assert res[r]["stats"]["worker"]["threads"] == threads
        fo = res[r]["stats"]["failover"]
        assert fo["ops_over_gloo"] >= ops // 2, fo  # the kill came early in the run
        assert res[r]["stats"]["switch_ops"]["allreduce"] >= ops


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hook", ["quorum", "switchml16"])
def test_a_hooks_group_fails_over_to_gloo_mid_training_and_its_ranks_stay_identical(hook):
    """DDP with the quorum hook on a group of 3 with quorum 2, or with the 16-bit switchml
    hook (its buckets in 16-bit fixed point, with error feedback): the switch is killed
    mid-run, and the group goes on over gloo (exact sums of every rank from then on) within
    its timeout; every rank ends with the same model, bit for bit, as the hook's sums and the
    hand-over of the last results keep them. (The 16-bit hook's buckets went to the switch
    job directly, and DDP failed when it died.)"""
    world, steps = 3, 40
    with tp.Procs(deadline_s=100) as procs:
        switch_proc = procs.start(tp.switch_server_body, procs.q, 0)
        kind, address, _pid = procs.get(timeout=30)
        assert kind == "switch"
        env = {"SWITCHML_SWITCH": f"{address[0]}:{address[1]}", "SWITCHML_FAILOVER": "gloo",
               "SWITCHML_FAILOVER_PROBE_S": "0"}
        if hook == "quorum":
            env["SWITCHML_QUORUM"] = str(world - 1)
        procs.start_ranks(tp.hook_failover_body, world, TIMEOUT_S, steps, hook, env=env)
        started = set()
        while len(started) < world:
            msg = procs.get(timeout=45)
            assert msg[0] == "progress", msg
            started.add(msg[1])
        switch_proc.kill()
        res = procs.results(list(range(world)), timeout=60)
    for r in range(world):
        fo = res[r]["stats"]["failover"]
        assert fo["switch_overs"] == 1 and fo["error"] is None and fo["active"], fo
        assert fo["ops_over_gloo"] > 0, fo
        assert max(res[r]["seconds"]) < TIMEOUT_S + 3, res[r]["seconds"]
        assert np.array_equal(res[r]["final"], res[0]["final"]), r
    if hook == "quorum":  # before the kill the switch's sums held 2 of the 3 ranks
        assert sum(res[r]["stats"]["switch_ops"].get("allreduce_partial", 0)
                   for r in range(world)) > 0
    else:  # every bucket went through the group in 16 bits, before the kill and after
        for r in range(world):
            assert res[r]["stats"]["switch_ops"]["bucket16"] == res[r]["hook_buckets"] > 0


@pytest.mark.timeout(150)
def test_a_rank_that_missed_the_last_results_takes_them_from_a_peer():
    """Rank 1's results stop reaching it a second before the switch dies: the others
    complete an all-reduce it never sees complete. At the switch-over it takes that sum from
    rank 0's copy (summing again over gloo would round it differently), then all go on."""
    world, ops = 3, 40
    res = _run(world, ops, relay_rank=1)
    assert res[1]["stats"]["failover"]["results_taken_from_peers"] >= 1, res[1]["stats"]
    assert res[0]["stats"]["failover"]["results_given_to_peers"] >= 1, res[0]["stats"]


@pytest.mark.timeout(150)
def test_the_group_goes_back_to_a_returned_switch_and_fails_over_again_when_it_dies():
    """A new switch comes up at the same address two seconds after the group switched over
    to gloo (sooner, the workers would rejoin it as a restarted switch). Rank 0 finds it (it
    probes every second), every rank joins a fresh job there, and the run goes through it.
    Four seconds later that switch dies too: a second switch-over, numbered on from the
    first. Exact sums all along, the same parameters everywhere."""
    world, ops = 3, 240
    res = _run(world, ops, None, back_after_s=TIMEOUT_S + 2.0, again_after_s=4.0)
    for r in range(world):
        fo = res[r]["stats"]["failover"]
        assert fo["switch_backs"] == 1 and fo["switch_overs"] == 2, fo
        # the fresh job's client completed what came between, through the returned switch
        done_between = res[r]["stats"]["worker"]["operations_completed"]
        assert done_between >= 10, (done_between, fo)


def test_the_hand_over_rule_names_who_gives_and_refuses_without_a_copy():
    from switchml.torch.failover import HAS, KEEPS, LACKS, SUM_AGAIN, transition
    assert transition([HAS, HAS, KEEPS]) is None  # nobody lacks it
    assert transition([HAS, LACKS, KEEPS, KEEPS]) == 2  # the lowest rank that kept it
    assert transition([LACKS, LACKS, LACKS]) == SUM_AGAIN  # nobody wrote a switch sum
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0, 2\] lack this result"):
        transition([LACKS, HAS, LACKS])


def _roster_failover(**kw):
    """A failover with a roster (no gloo group until a switch-over) over a fresh store; its
    roster, if ever asked, refuses (the test looks at what comes before)."""
    import datetime

    import torch.distributed as dist

    from switchml.protocol.errors import RoundGone
    from switchml.torch.failover import Failover

    def no_roster(epoch, reason):
        raise RuntimeError("no roster in this test")

    store = dist.HashStore()
    return store, Failover(store, 0, 2, datetime.timedelta(seconds=5), keep_bytes=0,
                           close_switch=lambda: None, prefix="t", roster=no_roster,
                           stays=(RoundGone,), **kw)


def test_a_rank_too_far_behind_never_switches_the_job_over():
    """RoundGone (the rank fell past the switch's history) stays the user's; so does every
    later failure of that rank's switch path (its client failed because of it): no
    switch-over announced, and the rank no longer watches for the others' (it rejoins)."""
    from switchml.protocol.errors import OperationFailed, RoundGone
    from switchml.torch.failover import PendingOp
    store, fo = _roster_failover()
    try:
        ops = [PendingOp(fo.issue()[0], [], True, lambda e: None) for _ in range(2)]
        assert not fo.failed(ops[0], RoundGone("round gone"))
        assert not fo.failed(ops[1], OperationFailed("the client failed earlier"))
        assert not fo.active and not store.check(["t/switched/0"])
        store.set("t/switched/0", "1")  # another rank switches over
        time.sleep(1.2)  # (the watcher looks every 0.5 s)
        assert not fo.active
    finally:
        fo.close()


def test_a_replacement_takes_part_in_switch_overs_once_it_resumed():
    """A live job's replacement (``armed=False``) ignores a switch-over announced before it
    resumed (it holds nothing the others could need); ``number_from`` numbers it as the live
    rank did and arms it."""
    store, fo = _roster_failover(armed=False)
    try:
        store.set("t/switched/0", "1")
        time.sleep(1.2)
        assert not fo.active
        fo.number_from(4242)
        assert fo.numbered == 4242
        deadline = time.monotonic() + 5
        while not fo.active and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fo.active  # (its roster then refuses: this test's)
    finally:
        fo.close()
