"""The embedded switch lives and dies with its group's rank 0."""

from __future__ import annotations

import pytest
import torch_procs as tp

pytestmark = pytest.mark.slow  # every test spawns a process group


@pytest.fixture(scope="module")
def run():  # one 2-rank group, run to the end (processes exited) first
    with tp.Procs(deadline_s=60) as procs:
        procs.start_ranks(tp.lifecycle_body, 2)
        results = procs.results(2)
        procs.join(20)
        codes = [p.exitcode for p in procs.procs]
    return {"results": results, "codes": codes, "leftover": procs.leftover,
            "leftover_switches": procs.leftover_switches}


@pytest.mark.timeout(90)
def test_no_switch_remains_after_the_group_exits(run):
    assert all(r["ok"] for r in run["results"].values()), run["results"]
    assert run["codes"] == [0, 0], "ranks did not exit on their own"
    pid = run["results"][0]["switch_pid"]
    assert pid is not None, "rank 0 started no embedded switch"
    assert run["results"][1]["switch_pid"] is None, "rank 1 started a switch too"
    assert not tp.pid_alive(pid), f"embedded switch {pid} still running"
    assert run["leftover_switches"] == []
    assert run["leftover"] == []


@pytest.mark.timeout(90)
def test_destroy_process_group_stops_the_embedded_switch(run):
    # "stopped 2 s after the group is destroyed, or when rank 0 exits" (backend docstring)
    assert run["results"][0]["alive_after_destroy"] is False



@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay_s", [
    pytest.param(0.0, id="reinit_at_once"),
    pytest.param(3.0, id="reinit_after_grace"),
])
def test_reinitialised_group_works(delay_s):
    with tp.Procs(deadline_s=45) as procs:
        procs.start_ranks(tp.reinit_body, 2, delay_s, 3.0, tp.free_port())
        results = procs.results(2)
    assert procs.leftover_switches == []
    for rank, res in results.items():
        assert res["first_ok"], (rank, res)
        assert res["error"] is None, (rank, res)
        assert res["ops"] > 10, (rank, res)


@pytest.mark.timeout(60)
def test_destroying_one_subgroup_keeps_the_switch_for_the_others():
    with tp.Procs(deadline_s=45) as procs:
        procs.start_ranks(tp.subgroup_owner_body, 2, 3.0)
        results = procs.results(2)
    assert procs.leftover_switches == []
    for rank, res in results.items():
        assert res["before_ok"], (rank, res)
        assert res["error"] is None, (rank, res)
