"""PyTorch's own distributed tests for what switchml claims (all_reduce, broadcast, barrier,
subgroups, DDP on CPU), run on the "switchml" backend by ``pytorch_suite.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest")

SUITE = Path(__file__).with_name("pytorch_suite.py")
CLAIMED = ["test_all_reduce_sum", "test_all_reduce_group_sum", "test_all_reduce_full_group_sum",
           "test_all_reduce_max", "test_broadcast", "test_barrier",
           "test_DistributedDataParallelCPU"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pytorch_distributed_suite_passes_on_switchml():
    args = [sys.executable, str(SUITE), "-v"]
    for name in CLAIMED:
        args += ["-k", name]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=850)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    ran = int(re.search(r"Ran (\d+) tests", out).group(1))
    skipped = re.search(r"OK \(skipped=(\d+)\)", out)
    passed = ran - (int(skipped.group(1)) if skipped else 0)
    # every CPU variant of the claimed collectives ran (CUDA and gloo-only variants skip)
    assert passed >= 11, out[-5000:]
    for name in ("test_all_reduce_sum", "test_broadcast", "test_barrier",
                 "test_DistributedDataParallelCPU"):
        assert re.search(rf"\.{name}\) \.\.\. skipped", out) is None, f"{name} skipped"
        assert f".{name})" in out, f"{name} did not run:\n{out[-5000:]}"
