"""DDP communication hooks over a gloo group: switchml (32/16 bit), reference, no-op."""

from __future__ import annotations

import multiprocessing as mp
import socket

import hook_procs
import numpy as np
import pytest

from switchml.protocol.errors import ConfigError

CTX = mp.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trained():
    world, steps = 2, 40
    q = CTX.Queue()
    port = _free_port()
    procs = [CTX.Process(target=hook_procs.train_with_hooks, args=(r, world, port, steps, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = sorted((q.get(timeout=240) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, _, err in rows:
        assert err is None, f"rank {rank}: {err}"
    return [r[1] for r in rows]


def _max_rel_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


def test_switchml_hook_matches_the_reference(trained):
    for out in trained:
        # 32-bit fixed point: ~2**-28 of each block's max per step; 40 steps stay far below 1e-5
        assert _max_rel_diff(out["switchml"][0], out["allreduce"][0]) < 1e-5
    # all ranks end with the same parameters
    for k, v in trained[0]["switchml"][0].items():
        assert np.array_equal(v, trained[1]["switchml"][0][k])


def test_16_bit_hook_converges_like_the_reference_with_half_the_bytes(trained):
    for out in trained:
        ref_losses = out["allreduce"][1]
        losses16 = out["switchml16"][1]
        assert losses16[-1] < 0.2 * losses16[0]  # it trains
        assert abs(losses16[-1] - ref_losses[-1]) <= 0.05 * ref_losses[-1] + 1e-4
        assert _max_rel_diff(out["switchml16"][0], out["allreduce"][0]) < 1e-2
        bytes32, bytes16 = out["switchml"][2], out["switchml16"][2]
        assert bytes16 == bytes32 // 2, (bytes16, bytes32)
    for k, v in trained[0]["switchml16"][0].items():
        assert np.array_equal(v, trained[1]["switchml16"][0][k])


def test_noop_hook_really_skips_communication(trained):
    # without aggregation the ranks' parameters drift apart (their data differ)
    a, b = trained[0]["noop"][0], trained[1]["noop"][0]
    assert any(not np.array_equal(a[k], b[k]) for k in a)


def test_hook_arguments_are_checked():
    from switchml.torch.hooks import SwitchMLHookState, register_hook
    with pytest.raises(ConfigError, match="bits must be 32 or 16"):
        SwitchMLHookState(bits=8)
    with pytest.raises(ValueError, match="known: switchml, switchml16, allreduce, noop"):
        register_hook(None, "fastest")  # type: ignore[arg-type]
