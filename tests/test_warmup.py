"""``python -m switchml.warmup`` compiles every kernel signature that switchml's transports run,
so that no operation on a fresh install waits for numba's compiler.

It once did not: the retransmit kernel, the generic receive path's batch cutter and the fast
path with an integer operation timeout were compiled, on a fresh clone, inside the first
operation that needed them (a minute on a 2-core machine), long enough for the switch to expire
the job's lease (the soak test failed in half of the fresh-clone CI runs).

A fresh process runs the warm-up, notes every kernel's compiled signatures, then drives the
transports as users do (UDP, fast path and generic path, every element kind, loss, a sharded
switch, a rack under a spine). No kernel may gain a signature: one it gained is one that a
fresh install would compile in the middle of an operation.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent("""
    import importlib, pkgutil, threading
    import numpy as np
    from numba.core.registry import CPUDispatcher
    from switchml.warmup import warm_up

    def kernels():
        pkg = importlib.import_module("switchml.protocol.kernels")
        names = [f"switchml.protocol.kernels.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
        out = {}
        for name in [*names, "switchml.transport.fastpath", "switchml.transport.switchpath"]:
            for key, obj in vars(importlib.import_module(name)).items():
                if isinstance(obj, CPUDispatcher) and obj.__module__ == name:
                    out[f"{name}.{key}"] = obj
        return out

    warm_up()
    before = {k: set(d.signatures) for k, d in kernels().items()}

    from switchml.control import new_job_spec
    from switchml.protocol.config import SwitchConfig, WorkerConfig
    from switchml.protocol.tree import RackAggregator, TreeConfig, tree_specs
    from switchml.transport.faults import LossyEndpoint
    from switchml.transport.udp import SwitchServer, WorkerClient

    KINDS = ((np.float32, 32, False), (np.float64, 32, False), (np.int32, 32, False),
             (np.float16, 32, False), (np.float32, 16, True), (np.float64, 16, True),
             (np.float32, 16, False))

    def job(addrs, spec, n, kinds, loss=0.0, config=None):
        errors = []
        def rank(r):
            try:
                wrap = (lambda s: LossyEndpoint(s, loss, r)) if loss else None
                with WorkerClient(addrs, spec, r, config, wrap=wrap) as w:
                    for dtype, bits, residual in kinds:
                        x = (np.arange(20_000) % 97).astype(dtype)
                        res = np.zeros(x.size, dtype) if residual else None
                        out = w.allreduce(x, bits=bits, residual=res)
                        assert np.allclose(out, n * x.astype(np.float64), rtol=1e-2), dtype
            except BaseException as exc:
                errors.append(exc)
        ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
        assert not errors, errors

    sw = SwitchServer(host="127.0.0.1", port=0).start()
    spec = lambda n: new_job_spec(n, window=8, elements_per_packet=256)
    job(sw.address, spec(2), 2, KINDS)                                  # the fast path
    job(sw.address, spec(2), 2, KINDS, loss=0.05,                       # generic, retransmits
        config=WorkerConfig(op_timeout_s=20, max_rto_s=0.2))
    job(sw.address, spec(2), 2, KINDS[:1], loss=0.05,
        config=WorkerConfig(op_timeout_s=20, max_rto_s=0.2, fast_retransmit=True))
    shards = [SwitchServer(host="127.0.0.1", port=0,
                           config=SwitchConfig(shard_index=i, shard_count=2)).start()
              for i in range(2)]
    job([s.address for s in shards], spec(2), 2, KINDS[:3])              # a sharded switch
    parent, child = tree_specs(spec(2), 1)                              # a rack under a spine
    rack = RackAggregator(parent_spec=parent, child_spec=child, rack=0,
                          parent_address=sw.address, config=TreeConfig(parent_timeout_s=5.0))
    rack_srv = SwitchServer(host="127.0.0.1", port=0, dataplane=rack).start()
    rack_srv.run_command(rack.join)
    job(rack_srv.address, child, 2, KINDS[:3], loss=0.05,
        config=WorkerConfig(op_timeout_s=20, max_rto_s=0.2))
    for s in (sw, *shards, rack_srv):
        s.stop()

    gained = {k: sorted(map(str, set(d.signatures) - before[k]))
              for k, d in kernels().items() if set(d.signatures) - before[k]}
    for name, sigs in gained.items():
        print("COMPILED AFTER WARM-UP:", name, *sigs, sep="\\n  ")
    print("gained", len(gained))
""")


def test_the_warm_up_compiles_every_signature_the_transports_run():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("gained 0"), proc.stdout[-6000:]
