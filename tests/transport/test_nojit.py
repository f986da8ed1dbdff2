"""``NUMBA_DISABLE_JIT=1`` (the switch's numba kernels as plain Python, for debugging) still
all-reduces exactly over UDP; the worker's data plane is C (``switchml._worker``) either way,
its compiled loop included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import numpy as np
from numba import config
assert config.DISABLE_JIT
from switchml.control import new_job_spec
from switchml.transport.udp import SwitchServer, WorkerClient
with SwitchServer(port=0) as s:
    spec = new_job_spec(num_workers=1, elements_per_packet=64, window=4)
    with WorkerClient(s.address, spec, 0) as w:
        assert w._fast is not None  # (C: no numba in the worker's path)
        x = np.arange(-300, 300, dtype=np.int32)
        assert np.array_equal(w.allreduce(x), x)
        f = np.linspace(-1, 1, 500, dtype=np.float32)
        assert np.max(np.abs(w.allreduce(f) - f)) < 1e-6
print("ok")
"""


@pytest.mark.slow
def test_allreduce_over_udp_with_the_jit_disabled():
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
