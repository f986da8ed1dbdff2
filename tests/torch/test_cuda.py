"""CUDA tensors on the "switchml" backend: the host-copy path (pinned staging buffers, the sum
written back to the device). Runs where torch sees a GPU; skipped, saying so, elsewhere."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch_procs as tp

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the host-copy path of CUDA tensors is "
                                       "tested only where torch sees a GPU")


def test_importing_the_backend_asks_nothing_of_cuda():
    # torch.cuda.is_available() initializes the driver, after which a forked child cannot use
    # CUDA: asked at `import switchml.torch`, it failed every forked rank on a GPU machine.
    code = ("import torch, torch.distributed as dist\n"
            "def asked(*a, **k): raise AssertionError('CUDA asked at import')\n"
            "torch.cuda.is_available = torch.cuda.device_count = asked\n"
            "torch._C._cuda_getDeviceCount = asked\n"
            "import switchml.torch\n"
            "print(dist.Backend.backend_capability['switchml'])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['cpu', 'cuda']"


@needs_cuda
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cuda_tensors_are_summed_in_place_on_their_device_and_ddp_agrees():
    with tp.Procs(deadline_s=180) as procs:
        procs.start_ranks(tp.cuda_body, 2)
        got = procs.results(2)
    for rank in (0, 1):
        for name in ("float32", "bfloat16"):
            device, same_dtype, in_place, err = got[rank][name]
            assert (device, same_dtype, in_place, err) == ("cuda", True, True, 0.0), name
        rel, untouched = got[rank]["view"]
        assert rel < 1e-6 and untouched
    assert got[0]["params"] == got[1]["params"]  # DDP: every rank steps on the same average
