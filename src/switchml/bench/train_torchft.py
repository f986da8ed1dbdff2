"""torchft in ``switchml bench train`` (system ``torchft``): the same replicas that come and go
as ``switchml-live``'s, with torchft's fault tolerance instead of ours, so that a killed worker
and its replacement cost the same job side by side.

Each rank is a torchft replica group of one (replica id ``replica<rank>``): a ``Manager`` with a
reconfigurable ``ProcessGroupGloo`` across the replicas, 32-bit, its group's ``TCPStore``
served by itself, torchft's ``DistributedDataParallel`` (buckets never rebuilt) and
``OptimizerWrapper`` (a quorum at the lighthouse at every step's ``zero_grad``, the step
committed only if every replica in it succeeded). The lighthouse runs in the switch's
namespace, waiting for ``n - 1`` replicas. A replacement heals: its first quorum finds it
behind, and a live replica sends it the state over the process group (``PGTransport``; the
default HTTP transport names the host by a host name that the testbed's namespaces share).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

__all__ = ["LIGHTHOUSE_PORT", "start_lighthouse", "train"]

LIGHTHOUSE_PORT = 29510
STORE_PORT = 29520


def start_lighthouse(tb: Any, min_replicas: int) -> Any:
    """torchft's lighthouse in the switch's namespace: quorums of at least ``min_replicas``."""
    import subprocess

    from switchml.bench.geo_torchft import lighthouse_path
    return tb.popen(tb.switch_ns, [lighthouse_path() or "torchft_lighthouse",
                                   "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}",
                                   "--min_replicas", str(min_replicas),
                                   "--join_timeout_ms", "1000"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train(a: dict[str, Any], task: Any, model: Any, work: Any) -> dict[str, Any]:
    """Train ``model`` to ``a["steps"]`` committed steps as torchft replica ``a["rank"]``;
    exits abruptly as step ``a["die_at"]`` begins. What ``nsproc.train`` reports, for the
    rows ``around_the_replacement`` reads."""
    import os
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=a.get("timeout_s", 120))
    _store = TCPStore(a["host_ip"], STORE_PORT, is_master=True, wait_for_workers=False,
                     timeout=timeout)
    inner = work.optimizer(model.parameters())

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        inner.load_state_dict(s["optim"])

    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg, min_replica_size=a["n"] - 1, use_async_quorum=False, load_state_dict=load,
        state_dict=state, replica_id=f"replica{a['rank']}", store_addr=a["host_ip"],
        store_port=STORE_PORT, rank=0, world_size=1, lighthouse_addr=a["lighthouse"],
        hostname=a["host_ip"], port=0, timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, init_sync=False,
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")))
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, inner)
    from switchml.bench.cpu import machine_busy_s
    from switchml.bench.hybridtrain import link_bytes
    dev, half = a.get("dev"), a["steps"] // 2
    bytes_half: int | None = None
    busy_half = 0.0
    losses, times, walls, evals = [], [], [], []
    t0 = time.perf_counter()
    paused, every, start, joined = 0.0, a.get("eval_every") or 0, None, 0
    while manager.current_step() < a["steps"]:
        step = manager.current_step()
        if step == a.get("die_at"):
            os._exit(0)  # a worker dies (no goodbye)
        loss, _ = task.timed_step(ddp, opt, step)
        if manager.current_step() <= step:
            continue  # not committed (a replica failed in it): the step is retried
        step = manager.current_step() - 1  # (a replacement: the step it healed to)
        if start is None:
            start = step
        if step == half and dev:
            bytes_half, busy_half = link_bytes(dev), machine_busy_s()
        joined += manager.num_participants() == a["n"]
        losses.append(loss.item())
        times.append(time.perf_counter() - t0 - paused)
        walls.append(time.time())
        if every and (step + 1) % every == 0 or step + 1 == a["steps"]:
            e0 = time.perf_counter()
            model.eval()
            evals.append((step + 1, times[-1], task.evaluate(model)))
            model.train()
            paused += time.perf_counter() - e0
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    manager.shutdown(wait=False)
    after = a["steps"] - 1 - half  # (steps from half on; evaluations counted in the CPU)
    extra = ({"link_bytes_per_step": (link_bytes(dev) - bytes_half) / after,
              "machine_cpu_s_per_step": (machine_busy_s() - busy_half) / after}
             if dev and bytes_half is not None and after > 0 else {})
    return {**extra, "losses": losses, "times": times, "walls": walls, "evals": evals,
            "elapsed_s": time.perf_counter() - t0,
            "start_step": start, "params_digest": digest,
            "contributed": joined / len(losses) if losses else 0.0,
            "mode": "ddp", "params": sum(p.numel() for p in model.parameters())}
