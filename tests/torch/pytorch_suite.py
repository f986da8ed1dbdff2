"""PyTorch's own distributed tests, on the "switchml" backend.

``torch.testing._internal.distributed.distributed_test`` is the suite PyTorch runs against
gloo, NCCL and MPI (its ``test/distributed/test_distributed_spawn.py``); a third-party
backend runs it by registering itself as a plugin with the features it claims. switchml
claims collectives (all_reduce through the switch; the rest on its internal gloo group), DDP
and subgroups. Run::

    python tests/torch/pytorch_suite.py -k test_all_reduce_sum -k test_broadcast ...

(``tests/torch/test_pytorch_suite.py`` runs the selection switchml claims.)
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.pop("CI", None)  # (under CI, PyTorch's harness writes JUnit XML with xmlrunner)
os.environ.setdefault("BACKEND", "switchml")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="switchml-torch-suite-"))

import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import switchml.torch  # noqa: E402,F401  registers the backend (also in every spawned rank)

for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("switchml")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestSwitchMLBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        # Forked, not spawned, ranks: each test's ranks start with torch and switchml already
        # imported (spawning them cost about 8 s a test here, two thirds of the suite's time).
        # The parent has started no thread and touched no accelerator before the fork.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


if __name__ == "__main__":
    sys.exit(run_tests())
