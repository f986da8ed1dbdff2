"""Helpers of the protocol tests (the endpoints on the in-memory fabric), as session fixtures
whose value is the helper function."""

from __future__ import annotations

import pytest

from switchml.protocol.wire import unpack_header


@pytest.fixture(scope="session")
def drop_once():
    """A function: ``drop, state = drop_once(match)`` gives a fabric ``drop_filter`` that drops
    the first datagram whose header ``match(header, src, dst)`` accepts, and its state:
    ``state["dropped"]`` is how many it dropped (0 or 1)."""
    def drop_once(match) -> tuple:
        state = {"dropped": 0}

        def drop(payload: bytes, src, dst) -> bool:
            if state["dropped"]:
                return False
            try:
                h = unpack_header(payload)
            except Exception:  # noqa: BLE001 - not a header: not ours to judge here
                return False
            if match(h, src, dst):
                state["dropped"] += 1
                return True
            return False

        return drop, state
    return drop_once
