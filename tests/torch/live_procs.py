"""Process bodies for ``test_torch_live.py``: replicas of one job, each its own process with
a one-process gloo group, averaging through a quorum job (``switchml.torch.live``)."""

from __future__ import annotations

import datetime
import time
import traceback
from typing import Any


def replica_main(q: Any, rank: int, world: int, store_port: int, switch: str, steps: int,
                 die_step: int | None, replacement: bool, pace_s: float,
                 warm_up: bool = True) -> None:
    """Train ``steps`` steps (SGD with momentum, so the optimizer's state matters) and report
    ``("result", rank, ...)``; with ``die_step``, exit abruptly before that step's backward
    (after saying ``("died", rank, step)``); a ``replacement`` starts from the live state.
    Rank 1 pauses for 30 paces before step 1 and catches up from a live rank's state (more
    than 10 steps behind); rank 2 pauses for 5 before step 45 (well after rank 1 caught up,
    so that the quorum of three goes on without it) and takes the steps its peers are past
    from their sums without computing them.
    The original replicas sleep ``pace_s`` before each step (so that a replacement finds
    the job running)."""
    from torch_procs import exit_now
    try:
        q.put(("result", rank, _train(q, rank, world, store_port, switch, steps, die_step,
                                      replacement, pace_s, warm_up)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, traceback.format_exc()))
    exit_now(q)


def _replica(rank: int, world: int, store_port: int, switch: str, replacement: bool,
             warm_up: bool, **live_args: Any) -> tuple[Any, Any, Any, Any, int]:
    """One replica's parts: its one-process group, its ``LiveQuorum`` (quorum ``world - 1``,
    with ``live_args``), the model and optimizer (a replacement's from the live state), DDP
    with the live hook; and the step it starts at."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from switchml.torch.live import LiveQuorum

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    live = LiveQuorum(store, rank, world, world - 1, switch=switch, replacement=replacement,
                      **live_args)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if live.state is not None:
        model.load_state_dict(live.state["model"])
        opt.load_state_dict(live.state["opt"])
        step = live.state["step"]
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets once DDP rebuilds them
    live.register(ddp)
    if replacement and warm_up:
        live.warm_up(lambda: ddp(torch.zeros(32, 16)).square().mean())
    return live, model, opt, ddp, step


def _train(q: Any, rank: int, world: int, store_port: int, switch: str, steps: int,
           die_step: int | None, replacement: bool, pace_s: float, warm_up: bool
           ) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch_procs import exit_now

    t_start = time.monotonic()
    live, model, opt, ddp, step = _replica(rank, world, store_port, switch, replacement,
                                           warm_up, timeout_s=20.0)
    start_step = step
    step_s, first_step_done_s, skipped, not_computed = [], None, 0, 0
    while step < steps:
        if rank == 0 and step == 2:
            q.put(("progress", rank, step))
        if step == die_step and not replacement:
            exit_now(q, ("died", rank, step))
        if live.skip_step():  # the others are past this step: its sums, not computed
            opt.step()
            not_computed += 1
        else:
            if not replacement and pace_s:
                time.sleep(pace_s)
            if (rank, step) in ((1, 1), (2, 45)) and not replacement:
                time.sleep((30 if rank == 1 else 5) * pace_s)  # the others go on meanwhile
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * rank + step))
            opt.zero_grad()
            loss = ddp(x).square().mean()
            t0 = time.monotonic()
            loss.backward()
            opt.step()
            step_s.append(time.monotonic() - t0)
        step += 1
        if first_step_done_s is None:
            first_step_done_s = time.monotonic() - t_start
        live.serve(lambda step=step: {"model": model.state_dict(), "opt": opt.state_dict(),
                                      "step": step})
        caught = live.catch_up(max_steps_behind=10)  # (far behind: skip to the live state)
        if caught is not None:
            model.load_state_dict(caught["model"])
            opt.load_state_dict(caught["opt"])
            skipped += caught["step"] - step
            step = caught["step"]
    params = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    stats = live.stats()
    live.close()
    return {"params": params, "step_s": step_s, "start_step": start_step, "stats": stats,
            "first_step_done_s": first_step_done_s, "skipped": skipped,
            "not_computed": not_computed}


def failover_replica_main(q: Any, rank: int, world: int, store_port: int, switch: str,
                          steps: int, die_step: int | None, replacement: bool,
                          report_step: int, timeout_s: float,
                          die_after_back: int | None = None) -> None:
    """A replica of a live job with ``failover="gloo"`` (quorum ``world - 1``, probing for
    the switch's return every second): ``steps`` steps 50 ms apart, saying ``("progress",
    rank, step)`` at ``report_step``; with ``die_step`` (an original replica), it exits
    abruptly there, with ``die_after_back`` that many steps after the job went back to the
    switch (``("died", rank, step)``); a ``replacement`` starts from the live state. Reports
    ``("result", rank, ...)``: each step's seconds, the final parameters and the stats."""
    from torch_procs import exit_now
    try:
        q.put(("result", rank, _train_through_failover(
            q, rank, world, store_port, switch, steps, die_step, replacement, report_step,
            timeout_s, die_after_back)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, traceback.format_exc()))
    exit_now(q)


def _train_through_failover(q: Any, rank: int, world: int, store_port: int, switch: str,
                            steps: int, die_step: int | None, replacement: bool,
                            report_step: int, timeout_s: float, die_after_back: int | None
                            ) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch_procs import exit_now

    live, model, opt, ddp, step = _replica(rank, world, store_port, switch, replacement, True,
                                           timeout_s=timeout_s, failover="gloo",
                                           failover_probe_s=1.0)
    start_step = step
    step_s = []
    back_at = None
    while step < steps:
        if step == die_step and not replacement:
            exit_now(q, ("died", rank, step))
        if back_at is None and live.stats()["failover"].get("switch_backs"):
            back_at = step
        if die_after_back is not None and back_at is not None \
                and step == back_at + die_after_back:
            exit_now(q, ("died", rank, step))
        if step == report_step:
            q.put(("progress", rank, step))
        t0 = time.monotonic()
        if live.skip_step():
            opt.step()
        else:
            time.sleep(0.05)
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * rank + step))
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        step_s.append(time.monotonic() - t0)
        step += 1
        live.serve(lambda step=step: {"model": model.state_dict(), "opt": opt.state_dict(),
                                      "step": step})
    params = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    stats = live.stats()
    live.close()
    return {"params": params, "step_s": step_s, "start_step": start_step, "stats": stats,
            "back_at": back_at}
