"""Shared test set-up: compile the per-packet kernels once, before any test runs.

A fresh checkout compiles them into numba's cache (about 40 s on 2 cores); tests that start
worker and switch processes then load them from the cache instead of each compiling them
under its own time limit.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _compiled_kernels() -> None:
    from switchml.protocol.warmup import warm_up
    warm_up()
