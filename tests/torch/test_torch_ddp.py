"""DDP training on switchml against gloo, and switchml against itself (bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_procs as tp

WORLD = 3
STEPS = 20

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


@pytest.fixture(scope="module")
def runs():
    """gloo, switchml, switchml over two I/O threads per rank: each a process group lifetime
    in 3 freshly spawned ranks. The switchml runs cut DDP's buckets into 64-element blocks
    over 4 slots, so that the two threads' parts both carry every bucket.

    ``runs[rank][i]`` is config i's result on that rank.
    """
    out: dict[int, list] = {r: [] for r in range(WORLD)}
    small = {"SWITCHML_ELEMENTS_PER_PACKET": "64", "SWITCHML_WINDOW": "4"}
    with tp.Procs(deadline_s=120) as procs:
        for backend, env in (("gloo", {}), ("switchml", small),
                             ("switchml", {**small, "SWITCHML_THREADS": "2"})):
            procs.start_ranks(tp.ddp_body, WORLD, backend, STEPS, env=env)
            for rank, res in procs.results(WORLD, timeout=60).items():
                out[rank].append(res)
    assert procs.leftover_switches == []
    assert procs.leftover == []
    return out


def _tensors(state):
    return {k: torch.from_numpy(v) for k, v in state.items()}


def test_switchml_training_matches_gloo(runs):
    gloo, sw = _tensors(runs[0][0]["final"]), _tensors(runs[0][1]["final"])
    init = _tensors(runs[0][0]["init"])
    # Tolerance. Per step every gradient element's all-reduce error is at most
    # n * 0.5 * 2**(emax - P) with P = 31 - bit_length(3) = 29, i.e. < 2**-28 * 2**emax where
    # 2**emax < 2 * (largest |gradient| in its 64-element block): about 1e-8 relative to the
    # block's largest gradient, while gloo's float32 ring sum itself rounds at ~6e-8 relative.
    # 20 SGD steps at lr 0.1 add up such differences (and a smooth tanh MLP barely amplifies
    # them), so the parameters stay within ~1e-6 of each other; rtol 1e-4 / atol 1e-5 leaves
    # a wide margin and still catches a missing division by the world size, a dropped bucket
    # or a stale gradient, each of which moves parameters by > 1e-2 (checked below).
    for k in gloo:
        assert torch.allclose(sw[k], gloo[k], rtol=1e-4, atol=1e-5), (
            k, float((sw[k] - gloo[k]).abs().max()))
    moved = max(float((gloo[k] - init[k]).abs().max()) for k in gloo)
    assert moved > 1e-2, f"training barely changed the model ({moved}): comparison is vacuous"


def test_two_threads_train_bit_identically_to_one(runs):
    # Integer sums on the switch do not depend on arrival order, quantization is
    # deterministic, and two threads' parts start on block boundaries: the same inputs give
    # the same bits, with one I/O thread per rank or two.
    assert all(runs[r][2]["stats"]["worker"]["threads"] == 2 for r in range(WORLD))
    assert all("threads" not in runs[r][1]["stats"]["worker"] for r in range(WORLD))
    a, b = _tensors(runs[0][1]["final"]), _tensors(runs[0][2]["final"])
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k] - b[k]).abs().max()))


def test_switchml_replicas_are_identical_across_ranks(runs):
    for run in (1, 2):
        ref = runs[0][run]["final"]
        for rank in range(1, WORLD):
            for k, v in runs[rank][run]["final"].items():
                assert np.array_equal(v, ref[k]), (run, rank, k)


def test_ddp_gradients_went_through_the_switch(runs):
    for rank in range(WORLD):
        for run in (1, 2):
            stats = runs[rank][run]["stats"]
            # one all-reduce per bucket per step; several buckets once DDP rebuilt them after
            # the first step
            assert stats["switch_ops"]["allreduce"] > STEPS, stats
            assert not any(k.startswith("allreduce") for k in stats["delegated"]), stats
