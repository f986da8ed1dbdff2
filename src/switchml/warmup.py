"""Compile (or load from numba's cache) every compiled kernel switchml runs: the protocol's
(``protocol/warmup.py``) and the UDP worker's compiled loop (``transport/fastpath.py``).

Run ``python -m switchml.warmup`` once after installing (``.ci/run`` and the README's set-up
do; the test suite does it first), so that no operation waits for the compiler.
"""

from __future__ import annotations

__all__ = ["warm_up"]


def warm_up() -> None:
    """Every kernel, for every operation kind."""
    from switchml.protocol.warmup import warm_up as warm_protocol
    from switchml.transport.fastpath import warm_up as warm_fast_path
    warm_protocol()
    warm_fast_path()


if __name__ == "__main__":
    warm_up()
    print("switchml kernels compiled and cached")
