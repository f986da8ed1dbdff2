"""Parameter servers as torchrun ranks: the last P ranks of a job serve, the others train.

Under ``torchrun --nproc-per-node N+P script.py``, every rank calls :func:`torchrun_role`. It
joins the job's gloo process group (from torchrun's environment), and the last ``servers`` ranks
start a :class:`ParameterServer` each; the servers' addresses reach every rank through an
``all_gather_object``. A server rank then serves until every worker said goodbye or died and
returns a role with ``is_server`` set (the script should just exit); a worker rank returns at
once with the addresses to give :class:`~switchml.ps.trainer.PSTrainer`.

Links. With ``SWITCHML_TLS_DIR`` (``links.py``) every server listens on all interfaces and every
connection is mutual TLS; the address a server advertises is ``SWITCHML_PS_HOST`` if set, else
this host's name resolved (set ``SWITCHML_PS_HOST`` on multi-machine jobs whose host names
resolve to loopback). Without credentials the servers listen on loopback only (a one-machine
job), and a non-loopback ``SWITCHML_PS_HOST`` is refused.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from switchml import env
from switchml.links import LinkSecurity, check_exposure
from switchml.protocol.errors import ConfigError
from switchml.ps.server import ParameterServer, ServerConfig

__all__ = ["PSRole", "torchrun_role"]


@dataclass
class PSRole:
    is_server: bool
    rank: int
    worker: int = -1
    """This rank's worker id (0..workers-1); -1 on a server."""
    workers: int = 0
    servers: list[tuple[str, int]] = field(default_factory=list)
    security: LinkSecurity | None = None
    """The links' credentials (``SWITCHML_TLS_DIR``): give them to ``PSTrainer``."""
    server_stats: dict[str, Any] = field(default_factory=dict)
    """A server's counters once its workers are done (``dropped_late`` among them)."""

    def close(self) -> None:
        """Leave the job's process group, all ranks together: a rank that tears gloo down
        while others still hold their connections to it aborted at exit ("terminate called
        without an active exception"), so every rank (servers once their workers are done,
        workers after training) waits at a barrier first."""
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def torchrun_role(*, servers: int, backup: int = 0, mode: str = "sync", optimizer: str = "sgd",
                  lr: float = 0.05, momentum: float = 0.0, timeout_s: float = 60.0,
                  serve_timeout_s: float = 24 * 3600.0) -> PSRole:
    """Decide this rank's role and start the servers (see the module docstring).

    Raises:
        ConfigError: fewer than one worker or one server in the job.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workers = world - servers
    if servers < 1 or workers < 1:
        raise ConfigError(f"a job of {world} ranks cannot have {servers} parameter servers "
                          "and at least one worker")
    server: ParameterServer | None = None
    mine: tuple[str, int] | None = None
    security = env.link_security()
    if rank >= workers:
        cfg = ServerConfig(workers, backup, mode, optimizer, lr, momentum, timeout_s)
        if security is None:
            host = env.ps_host() or "127.0.0.1"
            check_exposure(host, None, what=f"parameter-server rank {rank}")
            bind = "127.0.0.1"
        else:
            host = env.ps_host() or socket.gethostbyname(socket.gethostname())
            bind = "0.0.0.0"
        server = ParameterServer(rank - workers, cfg, host=bind, port=0,
                                 security=security).start()
        mine = (host, server.address[1])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    addresses = [tuple(a) for a in everyone[workers:]]
    if server is None:
        return PSRole(False, rank, rank, workers, addresses,  # type: ignore[arg-type]
                      security)
    server.wait_finished(serve_timeout_s)
    stats = server.stats()
    server.stop()
    return PSRole(True, rank, -1, workers, addresses, security,  # type: ignore[arg-type]
                  stats)
