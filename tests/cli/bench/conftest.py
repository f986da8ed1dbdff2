"""The benchmark commands make SIGTERM raise KeyboardInterrupt (so that their teardown runs):
put the test process's handler back after each test."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_sigterm() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)
