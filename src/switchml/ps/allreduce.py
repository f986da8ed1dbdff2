"""All-reduce through the parameter servers: the benchmarks' parameter-server baseline.

A server with optimizer ``sum`` (:class:`ServerConfig`) makes a shard the sum of the step's
gradients, so "push x, pull the next version" is an all-reduce whose traffic is a parameter
server's: every worker sends and receives its whole vector over the server's one link, bound
B/32 / n elements/s per worker (``switchml bench testbed``'s ``ps`` system).
"""

from __future__ import annotations

import numpy as np

from switchml.links import LinkSecurity
from switchml.ps.client import Address, PSClient
from switchml.ps.placement import place
from switchml.ps.server import ParameterServer, ServerConfig

__all__ = ["PSAllreduce", "sum_server"]


class PSAllreduce:
    """``ar(x, out)``: ``out`` = the sum of every worker's ``x`` (float32, ``numel``)."""

    def __init__(self, servers: list[Address], *, worker: int, numel: int,
                 workers: int | None = None, timeout_s: float = 300.0,
                 security: LinkSecurity | None = None) -> None:
        self.shards = place([("x", numel)], len(servers),
                            max_shard_elements=-(-numel // len(servers)))
        self.client = PSClient(servers, worker=worker, workers=workers, timeout_s=timeout_s,
                               connect_timeout_s=timeout_s, security=security)
        if worker == 0:  # the others' pushes wait at the server for this INIT
            self.client.init(self.shards, {s.shard_id: np.zeros(s.numel, np.float32)
                                           for s in self.shards})
        self.step = 0

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        grads = {s.shard_id: x[s.offset:s.offset + s.numel] for s in self.shards}
        self.client.push(self.shards, self.step, grads)
        views = {s.shard_id: out[s.offset:s.offset + s.numel] for s in self.shards}
        self.step = self.client.pull(self.shards, self.step + 1, views)

    def close(self) -> None:
        self.client.close()


def sum_server(*, port: int, workers: int, host: str = "0.0.0.0",
               timeout_s: float = 300.0, security: LinkSecurity | None = None,
               insecure: bool = False) -> ParameterServer:
    """A started server summing ``workers`` vectors per step (call ``wait_finished``);
    ``security`` / ``insecure`` as for :class:`ParameterServer`."""
    return ParameterServer(0, ServerConfig(workers=workers, optimizer="sum",
                                           timeout_s=timeout_s), host=host, port=port,
                           security=security, insecure=insecure).start()
