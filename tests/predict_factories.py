"""Model factories for ``switchml predict`` tests (importable by profiling processes)."""

from __future__ import annotations

import os


def fails_in_one_process(batch: int):  # noqa: ANN201 - a workloads factory
    """The digits CNN, except in the first process to build it (it raises): the others
    profile on and wait for it at the barrier."""
    from switchml import workloads
    try:
        fd = os.open(os.environ["SWITCHML_TEST_FAIL_ONCE"], os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return workloads.get("cnn").build(batch)
    os.close(fd)
    raise RuntimeError("this profiling process fails on purpose")
