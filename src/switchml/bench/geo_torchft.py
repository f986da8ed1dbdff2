"""torchft's DiLoCo in ``switchml bench geo`` (mode ``torchft``): the independent
implementation ours (``switchml.gaia.diloco``) is held against.

Each data centre is one torchft *replica group*: its workers train with DDP over gloo inside
it, as in mode ``diloco``, and each runs a torchft ``Manager`` (replica id ``dc<j>``, group rank
its rank in the data centre) with a reconfigurable ``ProcessGroupGloo`` across the data centres.
``torchft.local_sgd.DiLoCo`` hooks the inner optimiser: every ``inner_steps`` steps it takes a
quorum at the lighthouse, all-reduces (averages) the pseudo-gradients over gloo, 32-bit, and
steps an outer ``torch.optim.SGD`` with the same learning rate and (Nesterov) momentum as ours.
torchft has no leader: rank i of every replica group all-reduces with rank i of the others, so
each data centre sends its pseudo-gradient once per worker across the WAN (torchft issue 171).

The lighthouse (``torchft_lighthouse``, from the ``torchft`` wheel) runs in data centre 0's
router namespace; each data centre's store is a ``TCPStore`` served by its first worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

LIGHTHOUSE_PORT = 29510
STORE_PORT = 29520


def lighthouse_path() -> str | None:
    """``torchft_lighthouse``: on PATH, or beside this Python (a virtual environment's
    scripts, when it is not activated)."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return shutil.which("torchft_lighthouse") or (beside if os.access(beside, os.X_OK)
                                                  else None)


def available() -> str | None:
    """None if torchft and its lighthouse are installed here, else why not."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"torchft is not installed ({exc}); pip install torchft==0.2.0"
    if lighthouse_path() is None:
        return "torchft_lighthouse is not on PATH (it comes with the torchft wheel)"
    return None


def start_lighthouse(tb: Any, replicas: int) -> subprocess.Popen[Any]:
    """torchft's lighthouse in data centre 0's router, waiting for ``replicas`` replica groups
    (quorums are issued only when all of them are there: no data centre is ever left out)."""
    return tb.popen(tb.dc_ns(0), [lighthouse_path() or "torchft_lighthouse",
                                  "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}",
                                  "--min_replicas", str(replicas),
                                  "--join_timeout_ms", "60000"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_lighthouse(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def worker_args(geo: Any, r: int) -> dict[str, Any]:
    """Worker r's torchft addresses: the lighthouse (data centre 0's router, by the address
    worker r's route reaches it at) and its own address (advertised to the lighthouse)."""
    j = geo.dc_of(r)
    router = geo.gateway_ip(r) if j == 0 else geo.wan_router_ip(0)
    return {"lighthouse": f"http://{router}:{LIGHTHOUSE_PORT}", "host_ip": geo.worker_ip(r),
            "ft_store_port": STORE_PORT}


class TorchftDiLoCo:
    """torchft's DiLoCo around a worker's model and inner optimiser (which it hooks: the outer
    step runs inside ``opt.step()`` every ``inner_steps`` steps)."""

    def __init__(self, a: dict[str, Any], model: Any, opt: Any) -> None:
        from datetime import timedelta

        import torch
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
        timeout = timedelta(seconds=a["timeout_s"])
        self.store = None
        if a["local_rank"] == 0:  # the replica group's store (torchrun's job, elsewhere)
            self.store = TCPStore(a["dc_master"], a["ft_store_port"], is_master=True,
                                  wait_for_workers=False, timeout=timeout)
        self.model, self.opt = model, opt
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=len(a["leaders"]),
            use_async_quorum=False, load_state_dict=self._load, state_dict=self._state,
            replica_id=f"dc{a['dc']}", store_addr=a["dc_master"],
            store_port=a["ft_store_port"], rank=a["local_rank"], world_size=a["dc_size"],
            lighthouse_addr=a["lighthouse"], hostname=a["host_ip"], port=0, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout,
            # Every replica starts from the seed's weights, as in mode diloco; torchft's
            # first-step sync would fetch them over HTTP from an address named by host name,
            # which this testbed's namespaces do not resolve.
            init_sync=False)
        self.outer_opt = torch.optim.SGD(model.parameters(), lr=a["outer_lr"],
                                         momentum=a["outer_momentum"],
                                         nesterov=a["outer_momentum"] > 0)
        self.diloco = DiLoCo(self.manager, [model], opt, self.outer_opt,
                             sync_every=a["inner_steps"], backup_device=torch.device("cpu"),
                             pin_memory=False)
        self.diloco.__enter__()
        self.parameters = sum(p.numel() for p in model.parameters())

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def after_step(self) -> bool:
        """Nothing: torchft's outer step runs in the inner optimiser's post-step hook."""
        return False

    def stats(self) -> dict[str, Any]:
        """The outer steps torchft committed, and the float32 bytes it all-reduced."""
        steps = self.manager.current_step()
        return {"outer_steps": steps, "bytes_reduced": 4 * self.parameters * steps,
                "parameters": self.parameters, "participants": self.manager.num_participants()}

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
