"""Compile (or load from numba's cache) every compiled kernel switchml runs: the protocol's
(``protocol/warmup.py``), the UDP worker's compiled loop (``transport/fastpath.py``) and the
signatures that only the transports reach (retransmission, the generic receive path, a
sharded switch, a rack under a spine), by running small jobs over loopback.

Run ``python -m switchml.warmup`` once after installing (``.ci/run`` and the README's set-up
do; the test suite does it first), so that no operation waits for the compiler: on a 2-core
machine one kernel compiled inside an operation takes long enough for the switch to expire the
job's lease. ``tests/test_warmup.py`` checks that nothing the transports run is left out.
"""

from __future__ import annotations

__all__ = ["warm_up"]


def warm_up() -> None:
    """Every kernel, for every operation kind."""
    from switchml.protocol.warmup import warm_up as warm_protocol
    from switchml.transport.fastpath import warm_up as warm_fast_path
    from switchml.transport.switchpath import warm_up as warm_switch_path
    warm_protocol()
    warm_fast_path()
    warm_switch_path()
    _warm_transports()


def _warm_transports() -> None:
    """One single-rank job of every operation kind over loopback UDP: on the fast path, on
    the generic path with loss (retransmissions, fast retransmit), through a sharded switch and
    through a rack under a spine."""
    import numpy as np

    from switchml.control import new_job_spec
    from switchml.protocol.config import SwitchConfig, WorkerConfig
    from switchml.protocol.tree import RackAggregator, TreeConfig, tree_specs
    from switchml.protocol.warmup import KINDS
    from switchml.transport.faults import LossyEndpoint
    from switchml.transport.udp import SwitchServer, WorkerClient

    lossy = WorkerConfig(op_timeout_s=20.0, max_rto_s=0.05, initial_rto_s=0.02)

    def job(switch, spec, kinds, config=None, loss=0.0) -> None:
        wrap = (lambda s: LossyEndpoint(s, loss, seed=1)) if loss else None
        with WorkerClient(switch, spec, 0, config, wrap=wrap) as w:
            for dtype, bits, residual in kinds:
                x = np.arange(3000, dtype=dtype)
                w.allreduce(x, bits=bits, residual=np.zeros_like(x) if residual else None)

    def spec():
        return new_job_spec(1, window=4, elements_per_packet=64)

    servers = []
    try:
        spine = SwitchServer(host="127.0.0.1", port=0).start()
        servers.append(spine)
        job(spine.address, spec(), KINDS)
        job(spine.address, spec(), KINDS, lossy, loss=0.2)
        job(spine.address, spec(), KINDS, WorkerConfig(
            op_timeout_s=20.0, max_rto_s=0.05, initial_rto_s=0.02, fast_retransmit=True),
            loss=0.2)
        shards = [SwitchServer(host="127.0.0.1", port=0, config=SwitchConfig(
            shard_index=i, shard_count=2)).start() for i in range(2)]
        servers += shards
        job([s.address for s in shards], spec(), KINDS)
        parent, child = tree_specs(spec(), 1)
        rack = RackAggregator(parent_spec=parent, child_spec=child, rack=0,
                              parent_address=spine.address,
                              config=TreeConfig(parent_timeout_s=5.0))
        rack_server = SwitchServer(host="127.0.0.1", port=0, dataplane=rack).start()
        servers.append(rack_server)
        rack_server.run_command(rack.join)
        job(rack_server.address, child, KINDS, lossy, loss=0.2)
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    warm_up()
    print("switchml kernels compiled and cached")
