"""HybridDataParallel: the cost model's choices, and gradients / loss curves equal to DDP's."""

from __future__ import annotations

import numpy as np
import pytest
import torch_procs as tp
from hybrid_procs import CASES

from switchml.torch.hybrid import (
    AGGREGATE,
    SFB,
    Transport,
    aggregation_bytes,
    choose,
    sfb_bytes,
    transport_of,
)

SWITCH = Transport("switch", 4)
RING = Transport("ring", 4)


# -- cost model (no processes) -------------------------------------------------------------------

def test_byte_formulas():
    # switch: the vector out once and the sum in once, int32 each
    assert aggregation_bytes(1000, world=4, transport=SWITCH) == 2 * 1000 * 4
    assert aggregation_bytes(1000, world=4, transport=Transport("switch", 2)) == 2 * 1000 * 2
    # ring: 2(n-1)/n of the vector out and as much in
    assert aggregation_bytes(1000, world=4, transport=RING) == 2 * 2 * 3 / 4 * 1000 * 4
    assert aggregation_bytes(1000, world=1, transport=SWITCH) == 0
    # ring all-gather of K(M+N) float32 factors: (n-1) blocks out, (n-1) in
    assert sfb_bytes(16, 4096, 4096, world=4) == 2 * 3 * 16 * 8192 * 4


def test_wide_layer_small_batch_picks_sfb():
    d = choose("fc", in_features=4096, out_features=4096, rows=16, world=4, transport=SWITCH)
    assert d.path == SFB
    assert d.aggregation_bytes == 2 * 4096 * 4096 * 4
    assert d.sfb_bytes == 2 * 3 * 16 * 8192 * 4
    assert d.chosen_bytes == d.sfb_bytes
    assert "-> sfb" in str(d)


def test_narrow_layer_or_large_batch_picks_aggregation():
    assert choose("out", in_features=4096, out_features=10, rows=16, world=4,
                  transport=SWITCH).path == AGGREGATE
    assert choose("fc", in_features=4096, out_features=4096, rows=4096, world=4,
                  transport=SWITCH).path == AGGREGATE


def test_threshold_is_where_the_formula_says():
    # switch: sfb iff 2(n-1) K (M+N) < 2 M N  <=>  K < M N / ((n-1)(M+N))
    m, n_out, world = 1024, 512, 4
    k_star = m * n_out / ((world - 1) * (m + n_out))  # 113.8
    for k in (1, 113, 114, 200):
        d = choose("x", in_features=m, out_features=n_out, rows=k, world=world,
                   transport=SWITCH)
        assert d.path == (SFB if k < k_star else AGGREGATE), (k, d)
    # a ring all-reduce moves 2(n-1)/n of the vector each way: the threshold moves with it
    d = choose("x", in_features=m, out_features=n_out, rows=150, world=4, transport=RING)
    assert d.path == (SFB if 2 * 3 * 150 * 1536 < 4 * 3 / 4 * m * n_out else AGGREGATE)
    # no rows this step: aggregate (the missing gradient is then reported, not skipped)
    assert choose("x", in_features=m, out_features=n_out, rows=0, world=4,
                  transport=SWITCH).path == AGGREGATE


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kind must be"):
        Transport("tree", 4)
    with pytest.raises(ValueError, match="wire_bytes"):
        Transport("switch", 3)
    with pytest.raises(ValueError, match="sizes must be positive"):
        choose("x", in_features=0, out_features=3, rows=1, world=2, transport=SWITCH)


def test_buckets_are_cut_at_the_cap_and_where_the_dtype_changes():
    from switchml.torch.hybrid import cut_buckets
    # 10 + 10 fit a cap of 25, the third does not; 30 exceeds it alone; a float16 item
    # starts a bucket of its own even though it would fit
    items = [(10, "f32"), (10, "f32"), (10, "f32"), (30, "f32"), (1, "f32"), (1, "f16")]
    assert cut_buckets(items, 25) == [[0, 1], [2], [3], [4], [5]]
    assert cut_buckets([], 25) == []


def test_transport_of_a_non_switchml_group_is_a_ring():
    class FakeGroup:
        def name(self):
            return "gloo"
    assert transport_of(FakeGroup()) == RING


# -- against DDP on gloo (spawned ranks) ---------------------------------------------------------

STEPS = 12


def _run(backend: str, world: int, dtype: str = "float32") -> dict[int, dict]:
    with tp.Procs(deadline_s=150) as procs:
        procs.start_ranks(__import__("hybrid_procs").hybrid_vs_ddp_body, world, backend, STEPS,
                          dtype)
        out = procs.results(world, timeout=140)
    assert procs.leftover_switches == []
    return out


def _check(out: dict[int, dict], world: int, atol_rel: float, loss_rtol: float = 1e-4,
           loss_atol_rel: float = 0.0) -> None:
    for name, _widths, rows_by_rank, positions in CASES:
        decisions = out[0][name]["decisions"]
        # the comparison covers both paths in at least one case, and ranks agree
        for r in range(world):
            assert out[r][name]["decisions"] == decisions
        ks = [rows_by_rank[r % len(rows_by_rank)] * max(positions, 1) for r in range(world)]
        assert all(d[2] == max(ks) for d in decisions), decisions
        for r in range(world):
            ref, hyb = out[r][name]["ref"], out[r][name]["hybrid"]
            for p, g in ref["grads"].items():
                scale = float(np.abs(g).max())
                np.testing.assert_allclose(hyb["grads"][p], g, rtol=1e-5,
                                           atol=atol_rel * scale, err_msg=f"{name} {p} rank {r}")
            # loss curves: the same model state every step, so the same losses
            np.testing.assert_allclose(hyb["losses"], ref["losses"], rtol=loss_rtol,
                                       atol=loss_atol_rel * ref["losses"][0],
                                       err_msg=f"{name} rank {r}")
            assert ref["losses"][-1] < ref["losses"][0]  # training moved
    paths = {d[1] for name, *_ in CASES for d in out[0][name]["decisions"]}
    assert paths == {SFB, AGGREGATE}, paths


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_gradients_and_losses_equal_ddp_on_gloo(world):
    _check(_run("gloo", world), world, atol_rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_over_the_switchml_backend():
    out = _run("switchml", 2)
    # fixed-point aggregation: ~1e-8 of each block's largest value per step
    _check(out, 2, atol_rel=1e-5)
    stats = out[0]["stats"]
    assert stats["switch_ops"]["allreduce"] > 0, stats
    assert stats["delegated"].get("allgather_into_tensor", 0) > 0, stats


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_parameters_over_the_switchml_backend(dtype):
    # Parameters, gradients and factors in 16 bits on both sides; the references sum in
    # that type too (gloo's ring), so the tolerance is the type's: 8 (bfloat16) and 11
    # (float16) bits of mantissa, over 12 steps (losses: 5%, or 0.2% of the first loss once
    # they are tiny).
    out = _run("switchml", 2, dtype)
    _check(out, 2, atol_rel=3e-2 if dtype == "bfloat16" else 5e-3, loss_rtol=5e-2,
           loss_atol_rel=2e-3)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ddp", "hybrid"])
def test_communication_starts_during_backprop(mode):
    """Wait-free backprop, shown on the timeline: some communication of every step (after the
    first) is launched before that step's backward computation ends, and overlaps it."""
    steps = 6
    with tp.Procs(deadline_s=100) as procs:
        procs.start_ranks(__import__("hybrid_procs").trace_body, 2, mode, steps)
        out = procs.results(2, timeout=90)
    for rank in range(2):
        spans, backward = out[rank]["spans"], out[rank]["backward"]
        comm = [s for s in spans if s[1] == "comm"]
        assert comm, spans
        for start, end in backward[1:]:
            launched = [c for c in comm if start <= c[2] < end]
            assert launched, (mode, rank, start, end, comm)
        assert out[rank]["hidden_fraction"] > 0
        if mode == "hybrid":
            assert SFB in out[rank]["decisions"]
            assert any(c[0].startswith("sfb all_gather") for c in comm)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_misuse_raises_with_the_name():
    with tp.Procs(deadline_s=80) as procs:
        procs.start_ranks(__import__("hybrid_procs").errors_body, 2)
        out = procs.results(2, timeout=70)
    for rank in range(2):
        errs = out[rank]
        assert "exclude names no module: ['nope']" in errs["exclude"], errs
        assert "bucket_cap_mb must be > 0" in errs["bucket"], errs
        assert "layer 'fc' was called 2 times" in errs["twice"], errs
        assert "'spare.weight' got no gradient" in errs["unused"] or \
            "'spare.bias' got no gradient" in errs["unused"], errs
        assert errs["ok"] == "no error", errs
