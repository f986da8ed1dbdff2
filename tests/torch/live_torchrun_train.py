"""A training script as docs/torch.md's recipe for replicas that come and go has it, run by one
``torchrun --max-restarts 1`` per replica (``test_live_torchrun.py``). The replica that is told
to die exits with status 1 at a step on its first attempt; torchrun restarts it, and the
restarted process (``TORCHELASTIC_RESTART_COUNT`` > 0) joins the running job as a replacement.

Usage: live_torchrun_train.py REPLICA WORLD STORE_PORT DIE_STEP OUT_DIR
(DIE_STEP -1: never). SWITCHML_SWITCH names the switch.

The run ends at a step every replica agrees on: the replacement, once it has the live state,
puts "its first step + 120" in the store, and every replica runs until then (so that the
replicas can be compared, bit for bit, at the same step). The original replicas sleep a little
before each step, the restarted one does not."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from switchml.torch.live import LiveQuorum

MAX_STEPS, PACE_S = 3000, 0.02


def main() -> None:
    replica, world, store_port, die_step = (int(a) for a in sys.argv[1:5])
    out_dir = sys.argv[5]
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    live = LiveQuorum(store, replica, world, quorum=world - 1, replacement=restarted,
                      timeout_s=30.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if live.state is not None:  # a replacement: the live state
        model.load_state_dict(live.state["model"])
        opt.load_state_dict(live.state["opt"])
        step = live.state["step"]
        store.compare_set("end_step", "", str(step + 120))
    start_step = step
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    live.register(ddp)
    if live.state is not None:
        live.warm_up(lambda: ddp(torch.zeros(32, 16)).square().mean())
    end = MAX_STEPS
    while step < end:
        if step == die_step and not restarted:
            os._exit(1)  # a crash: torchrun restarts this replica
        if not live.skip_step():
            if not restarted:
                time.sleep(PACE_S)  # (the original replicas are slower: the restarted one,
                # once level, is among the quorum's first, and its data in the sums)
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * replica + step))
            opt.zero_grad()
            ddp(x).square().mean().backward()
        opt.step()
        step += 1
        live.serve(lambda step=step: {"model": model.state_dict(), "opt": opt.state_dict(),
                                      "step": step})
        if end == MAX_STEPS and store.check(["end_step"]):
            end = int(store.get("end_step"))
    params = torch.cat([p.detach().ravel() for p in model.parameters()])
    with open(os.path.join(out_dir, f"replica{replica}.json"), "w") as f:
        json.dump({"replica": replica, "restarted": restarted, "start_step": start_step,
                   "end_step": step, "params": params.tolist(), "stats": live.stats()}, f)
    live.close()


if __name__ == "__main__":
    main()
