"""docs/torch.md's recipe for replicas that come and go, launched as it says: one ``torchrun``
per replica, ``--max-restarts 1``. One replica crashes mid-run; torchrun restarts it, and the
restarted process joins the running job with the live state (``LiveQuorum(replacement=True)``
when ``TORCHELASTIC_RESTART_COUNT`` > 0). Every torchrun ends with status 0 and every replica
with the same parameters, bit for bit; the others never stopped. It fails on a switch that
refuses a rank joining a running job (before live membership, every job did): the restarted
replica's JOIN is refused, it fails again, and torchrun gives up."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WORLD, DIE_STEP = 3, 40
SCRIPT = Path(__file__).with_name("live_torchrun_train.py")


def test_a_replica_torchrun_restarts_joins_the_running_job(tmp_path):
    import torch.distributed as dist

    from switchml.transport.udp import SwitchServer
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    with SwitchServer(host="127.0.0.1", port=0) as switch:
        env = {**os.environ, "SWITCHML_SWITCH": f"{switch.address[0]}:{switch.address[1]}",
               "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent),
                                              os.environ.get("PYTHONPATH", "")])}
        runs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
             "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.1",
             str(SCRIPT), str(r), str(WORLD), str(store.port),
             str(DIE_STEP if r == WORLD - 1 else -1), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(WORLD)]
        try:
            outs = [p.communicate(timeout=120)[0] for p in runs]
        finally:
            for p in runs:
                p.kill()
        stats = switch.stats()
    for r, (p, out) in enumerate(zip(runs, outs)):
        assert p.returncode == 0, f"replica {r}'s torchrun:\n{out[-3000:]}"
    res = [json.loads((tmp_path / f"replica{r}.json").read_text()) for r in range(WORLD)]
    new = res[WORLD - 1]
    assert new["restarted"] and DIE_STEP < new["start_step"] < new["end_step"], new
    assert not any(r["restarted"] for r in res[:-1])
    assert len({r["end_step"] for r in res}) == 1
    for r in res:
        assert r["params"] == res[0]["params"], r["replica"]  # bit for bit (floats as JSON)
    assert sum(r["stats"]["states_served"] for r in res[:-1]) == 1
    assert stats["members_replaced"] == 1, stats
    # It contributed once level: most of its sums hold its data.
    assert new["stats"]["results_left_out"] < new["stats"]["results_received"] / 2, new["stats"]
