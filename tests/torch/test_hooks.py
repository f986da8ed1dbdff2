"""DDP communication hooks over a gloo group: switchml (32/16 bit), reference, no-op."""

from __future__ import annotations

import hook_procs
import numpy as np
import pytest
from torch_procs import CTX

from switchml.protocol.errors import ConfigError


def _ranks(target, args_of, world: int, timeout: float) -> list:
    """Run ``target(*args_of(rank), queue)`` in ``world`` processes; each puts ``(rank, result,
    error)``. Returns the results by rank; fails on any rank's error."""
    q = CTX.Queue()
    procs = [CTX.Process(target=target, args=(*args_of(r), q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = sorted((q.get(timeout=timeout) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, _, err in rows:
        assert err is None, f"rank {rank}: {err}"
    return [r[1] for r in rows]


@pytest.fixture(scope="module")
def trained(free_port):
    world, steps, port = 2, 40, free_port()
    return _ranks(hook_procs.train_with_hooks, lambda r: (r, world, port, steps), world, 240)


def _max_rel_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


@pytest.mark.slow
def test_switchml_hook_matches_the_reference(trained):
    for out in trained:
        # 32-bit fixed point: ~2**-28 of each block's max per step; 40 steps stay far below 1e-5
        assert _max_rel_diff(out["switchml"][0], out["allreduce"][0]) < 1e-5
    # all ranks end with the same parameters
    for k, v in trained[0]["switchml"][0].items():
        assert np.array_equal(v, trained[1]["switchml"][0][k])


@pytest.mark.slow
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


@pytest.mark.slow
def test_noop_hook_really_skips_communication(trained):
    # without aggregation the ranks' parameters drift apart (their data differ)
    a, b = trained[0]["noop"][0], trained[1]["noop"][0]
    assert any(not np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_lockstep_hook_waits_for_the_slowest_rank_and_moves_no_gradient(free_port):
    """Rank 1 starts each backward 0.5 s after rank 0: with ``lockstep`` rank 0's backward
    waits for it (at least 0.4 s), with ``noop`` it does not (well under that); neither
    averages the gradients, so the ranks' parameters differ (their data differ)."""
    world, port, delay = 2, free_port(), 0.5
    got = _ranks(hook_procs.lockstep_waits, lambda r: (r, world, port, delay), world, 120)
    noop_s, lock_s = got[0]["noop"][0], got[0]["lockstep"][0]
    assert min(lock_s) >= 0.8 * delay, lock_s
    assert max(noop_s) < 0.5 * delay, noop_s
    for name in ("noop", "lockstep"):
        a, b = got[0][name][1], got[1][name][1]
        assert any(not np.array_equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_hook_sizes_chunks_for_the_smallest_mtu_of_any_rank(free_port):
    """The backend's rule, not rank 0's MTU: rank 0 says 9000, rank 1 says 1500, and both
    ranks' jobs carry chunks that fit 1500-byte datagrams."""
    from switchml.protocol.wire import elements_for_mtu
    world, port, mtus = 2, free_port(), (9000, 1500)
    got = _ranks(hook_procs.hook_geometry, lambda r: (r, world, port, mtus[r]), world, 120)
    assert got == [elements_for_mtu(1500)] * world


def test_hook_arguments_are_checked():
    from switchml.torch.hooks import SwitchMLHookState, register_hook
    with pytest.raises(ConfigError, match="bits must be 32 or 16"):
        SwitchMLHookState(bits=8)
    with pytest.raises(ValueError, match="known: switchml, switchml16, allreduce, noop, lockstep"):
        register_hook(None, "fastest")  # type: ignore[arg-type]


class _Bucket:
    """What the hook uses of ``dist.GradBucket``."""

    def __init__(self, index, buffer, params):
        self._index, self._buffer, self._params = index, buffer, params

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params


def test_16_bit_residual_follows_the_buckets_parameters_not_only_its_index():
    """DDP rebuilds its buckets after the first step: bucket 0 may then hold other parameters
    of the same total size. Their gradient must not receive the old bucket's residual."""
    import torch

    from switchml.control import new_job_spec
    from switchml.torch.hooks import SwitchMLHookState, switchml_hook
    from switchml.transport.udp import SwitchServer, WorkerClient

    with SwitchServer(port=0) as server:
        state = object.__new__(SwitchMLHookState)
        state.bits, state.process_group, state.world_size = 16, None, 1
        state.residuals, state.buckets, state.bytes_sent = {}, 0, 0
        state._owns_client = state._owns_switch = False
        state.group = None  # (not on a switchml group)
        state.client = WorkerClient(server.address, new_job_spec(1, window=2), 0)
        try:
            first = [torch.zeros(4), torch.zeros(2)]
            other = [torch.zeros(3), torch.zeros(3)]  # same size, other layers
            grad = torch.tensor([0.1, 1e-3, 0.3, 7.7e-4, 0.5, 1e-5])
            out = switchml_hook(state, _Bucket(0, grad.clone(), first)).wait()
            layout, residual = state.residuals[0]
            assert layout == tuple((p.data_ptr(), p.numel()) for p in first)
            assert residual.abs().max() > 0  # 16 bits lose something: kept for next time
            assert torch.allclose(out + residual, grad, atol=1e-7)
            # The same bucket again: the residual is added (error feedback) and replaced.
            switchml_hook(state, _Bucket(0, grad.clone(), first)).wait()
            assert state.residuals[0][0] == layout
            # A rebuilt bucket 0 with other parameters: a fresh residual, nothing carried over.
            out = switchml_hook(state, _Bucket(0, grad.clone(), other)).wait()
            layout2, residual2 = state.residuals[0]
            assert layout2 == tuple((p.data_ptr(), p.numel()) for p in other)
            assert torch.allclose(out + residual2, grad, atol=1e-7)
        finally:
            state.client.close()


def test_lockstep_hook_fails_its_future_when_the_all_reduce_fails(monkeypatch):
    """A peer gone: the one-element all-reduce's future fails, and so must the bucket's, or
    DDP would step on a gradient no rank agreed on. A good all-reduce hands back the bucket
    untouched, its token on the bucket's device."""
    import torch
    import torch.distributed as dist

    from switchml.torch.hooks import lockstep_hook

    calls = []

    class _Work:
        def __init__(self, error):
            self.fut = torch.futures.Future()
            if error is None:
                self.fut.set_result([calls[-1]])
            else:
                self.fut.set_exception(error)

        def get_future(self):
            return self.fut

    error = None

    def all_reduce(tensor, group=None, async_op=False):
        calls.append(tensor)
        return _Work(error)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    grad = torch.tensor([1.0, -2.0, 3.0])
    out = lockstep_hook(None, _Bucket(0, grad, [])).wait()
    assert out is grad and out.tolist() == [1.0, -2.0, 3.0]
    assert calls[-1].numel() == 1 and calls[-1].device == grad.device
    error = RuntimeError("rank 1 is gone")
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        lockstep_hook(None, _Bucket(0, grad, [])).wait()
