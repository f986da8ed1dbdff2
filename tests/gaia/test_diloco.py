"""DiLoCo's outer loop (``gaia/diloco.py``) against independent references: model averaging
(outer learning rate 1, no momentum), synchronous SGD (one inner step), the paper's Nesterov
rule computed by hand, and the same through a switch on loopback in 16 bits."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from switchml.control import new_job_spec
from switchml.gaia.diloco import DiLoCo, switch_outer
from switchml.transport.udp import SwitchServer

DCS = 2


class _Exchange:
    """An exact all-reduce (a sum) between threads, one per data centre."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.parts: dict[int, np.ndarray] = {}

    def outer(self, dc: int):
        def reduce(x: np.ndarray) -> np.ndarray:
            self.parts[dc] = x.astype(np.float64)
            self.barrier.wait()
            total = sum(self.parts[d] for d in sorted(self.parts))
            self.barrier.wait()
            return total.astype(np.float32)
        return reduce


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batches(dc: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + dc)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


def _sgd_steps(model: nn.Module, batches, lr: float) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def _each_dc(train) -> None:
    """``train(d)`` for every data centre, each in a thread of its own (their outer
    all-reduces meet); re-raises what any of them raised."""
    errors: list[BaseException] = []

    def dc(d: int) -> None:
        try:
            train(d)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=dc, args=(d,)) for d in range(DCS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def _run_dcs(make_outer, steps: int, inner_steps: int, outer_lr: float, momentum: float,
             lr: float = 0.1) -> list[np.ndarray]:
    """Every data centre (a thread) trains its batches with DiLoCo; their final params."""
    models = [_model() for _ in range(DCS)]
    out: dict[int, np.ndarray] = {}

    def train(d: int) -> None:
        diloco = DiLoCo(models[d], outer=make_outer(d), dcs=DCS, inner_steps=inner_steps,
                        outer_lr=outer_lr, outer_momentum=momentum)
        opt = torch.optim.SGD(models[d].parameters(), lr=lr)
        for x, y in _batches(d, steps):
            opt.zero_grad()
            nn.functional.cross_entropy(models[d](x), y).backward()
            opt.step()
            diloco.after_step()
        out[d] = _flat(models[d])

    _each_dc(train)
    return [out[d] for d in range(DCS)]


def test_outer_lr_one_without_momentum_is_model_averaging():
    ex = _Exchange(DCS)
    got = _run_dcs(ex.outer, steps=3, inner_steps=3, outer_lr=1.0, momentum=0.0)
    local = []
    for d in range(DCS):  # each data centre alone, then the mean of the models
        m = _model()
        _sgd_steps(m, _batches(d, 3), 0.1)
        local.append(_flat(m))
    np.testing.assert_allclose(got[0], np.mean(local, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0], got[1])


def test_one_inner_step_is_synchronous_sgd_on_the_mean_gradient():
    ex = _Exchange(DCS)
    got = _run_dcs(ex.outer, steps=4, inner_steps=1, outer_lr=1.0, momentum=0.0)
    ref = _model()
    batches = [_batches(d, 4) for d in range(DCS)]
    for step in range(4):
        grads = []
        for d in range(DCS):
            ref.zero_grad()
            x, y = batches[d][step]
            nn.functional.cross_entropy(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * (grads[0][i] + grads[1][i]) / 2
    np.testing.assert_allclose(got[0], _flat(ref), rtol=1e-5, atol=1e-6)


def test_the_outer_step_is_the_papers_nesterov_rule():
    """Two outer steps of 2 inner steps each, checked against the rule written out in numpy:
    g = mean(anchor - local); m = mu m + g; anchor -= lr (g + mu m)."""
    ex = _Exchange(DCS)
    lr, mu = 0.7, 0.9
    got = _run_dcs(ex.outer, steps=4, inner_steps=2, outer_lr=lr, momentum=mu)
    anchor = _flat(_model())
    m = np.zeros_like(anchor)
    batches = [_batches(d, 4) for d in range(DCS)]
    for k in range(2):
        local = []
        for d in range(DCS):
            model = _model()
            torch.nn.utils.vector_to_parameters(torch.from_numpy(anchor.copy()),
                                                model.parameters())
            _sgd_steps(model, batches[d][2 * k:2 * k + 2], 0.1)
            local.append(_flat(model))
        g = np.mean([anchor - p for p in local], axis=0)
        m = mu * m + g
        anchor = anchor - lr * (g + mu * m)
    np.testing.assert_allclose(got[0], anchor, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[0], got[1])


def test_the_outer_all_reduce_through_a_switch_in_16_bits():
    """The same averaging with the leaders' all-reduce through a switch on loopback, 16-bit
    fixed point: the data centres agree bit for bit, within the quantisation of the exact
    mean."""
    ex = _Exchange(DCS)
    exact = _run_dcs(ex.outer, steps=3, inner_steps=3, outer_lr=1.0, momentum=0.0)[0]
    spec = new_job_spec(DCS)
    with SwitchServer(host="127.0.0.1", port=0) as server:
        outers = [switch_outer(server.address, dcs=DCS, dc=d, job_id=spec.job_id,
                               token=spec.token) for d in range(DCS)]
        try:
            got = _run_dcs(lambda d: outers[d], steps=3, inner_steps=3, outer_lr=1.0,
                           momentum=0.0)
        finally:
            for o in outers:
                o.close()
    np.testing.assert_array_equal(got[0], got[1])
    delta = np.abs(exact - _flat(_model())).max()  # the pseudo-gradient's scale
    assert np.abs(got[0] - exact).max() <= delta * 2.0 ** -13
    assert np.abs(got[0] - exact).max() > 0  # (16 bits do round)


@pytest.mark.parametrize("kw", [{"inner_steps": 0}, {"dcs": 0}, {"outer_lr": 0.0},
                                {"outer_momentum": 1.0}])
def test_wrong_arguments_say_what_is_wrong(kw):
    args = {"outer": lambda x: x, "dcs": 2, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        DiLoCo(_model(), **args)


# -- embedding tables: a row is averaged over the data centres that moved it ---------------------

class _Table(nn.Module):
    """An embedding table (6 rows) and a dense layer after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(1)


ROWS = {0: [0, 1, 0, 1], 1: [1, 2, 2, 1]}
"""The rows each data centre's batches touch: row 0 only in data centre 0, row 2 only in 1,
row 1 in both, rows 3-5 in neither."""


def _table_step(model: nn.Module, opt: torch.optim.Optimizer, row: int) -> None:
    opt.zero_grad()
    (model(torch.tensor([row])) - 1.0).pow(2).sum().backward()
    opt.step()


def _run_tables(make_outer, **kw) -> list[_Table]:
    models = [_Table() for _ in range(DCS)]

    def train(d: int) -> None:
        diloco = DiLoCo(models[d], outer=make_outer(d), dcs=DCS, inner_steps=4, outer_lr=1.0,
                        outer_momentum=0.0, **kw)
        opt = torch.optim.SGD(models[d].parameters(), lr=0.1)
        for row in ROWS[d]:
            _table_step(models[d], opt, row)
            diloco.after_step()

    _each_dc(train)
    return models


def _locals() -> list[_Table]:
    """Each data centre's model after its four steps alone (the reference)."""
    out = []
    for d in range(DCS):
        m = _Table()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for row in ROWS[d]:
            _table_step(m, opt, row)
        out.append(m)
    return out


def test_an_embedding_row_is_averaged_over_the_data_centres_that_moved_it():
    got = _run_tables(_Exchange(DCS).outer, embedding_rows=True)
    local, start = _locals(), _Table()
    emb = [m.emb.weight.detach() for m in local]
    want = start.emb.weight.detach().clone()
    want[0] = emb[0][0]  # only data centre 0 moved row 0: its row, whole
    want[2] = emb[1][2]  # only data centre 1 moved row 2
    want[1] = (emb[0][1] + emb[1][1]) / 2  # both moved row 1: their mean
    torch.testing.assert_close(got[0].emb.weight.detach(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(want[0], start.emb.weight[0])  # (the row did move)
    # the dense layer is the plain mean of the two models
    torch.testing.assert_close(got[0].out.weight.detach(),
                               (local[0].out.weight + local[1].out.weight).detach() / 2)
    torch.testing.assert_close(got[0].emb.weight, got[1].emb.weight, rtol=0, atol=0)


def test_by_default_every_row_is_the_plain_mean():
    got = _run_tables(_Exchange(DCS).outer)
    local = _locals()
    torch.testing.assert_close(got[0].emb.weight.detach(),
                               (local[0].emb.weight + local[1].emb.weight).detach() / 2)


def test_embedding_rows_through_a_switch_in_16_bits():
    """The row counts cross the switch in the same 16-bit all-reduce as the pseudo-gradient
    and come back whole: each row is within 16 bits' rounding of the exact row mean."""
    exact = _run_tables(_Exchange(DCS).outer, embedding_rows=True)[0].emb.weight.detach()
    spec = new_job_spec(DCS)
    with SwitchServer(host="127.0.0.1", port=0) as server:
        outers = [switch_outer(server.address, dcs=DCS, dc=d, job_id=spec.job_id,
                               token=spec.token) for d in range(DCS)]
        try:
            got = _run_tables(lambda d: outers[d], embedding_rows=True)
        finally:
            for o in outers:
                o.close()
    # Each block's quantum is at most 2 max|x| 2^-13 (16 bits, 2 data centres), the largest
    # pseudo-gradient entry bounds max|x|, and two roundings of half a quantum are summed
    # and divided by a count as small as 1.
    start = _flat(_Table())
    scale = max(np.abs(_flat(m) - start).max() for m in _locals())
    torch.testing.assert_close(got[0].emb.weight.detach(), exact, rtol=0,
                               atol=float(scale) * 2.0 ** -12)
    torch.testing.assert_close(got[0].emb.weight, got[1].emb.weight, rtol=0, atol=0)


@pytest.mark.parametrize("dcs", [1, 2, 3, 4, 8, 127])
def test_row_counts_packed_and_summed_come_back_whole(dcs):
    """Packed row counts summed in 16-bit fixed point (the switch's quantiser, a block of
    their own) and in float32 give every row's count, computed here by hand."""
    from switchml.gaia.diloco import RowCounts
    from switchml.protocol.quantize import block_exponent, quantize, scale_bits
    rows = 1000
    rng = np.random.default_rng(dcs)
    moved = rng.random((dcs, rows)) < 0.5
    counts = RowCounts(dcs)
    packed = [counts.pack(m) for m in moved]
    emax = max(block_exponent(p)[0] for p in packed)
    assert emax <= scale_bits(dcs, 16)  # whole numbers on a 16-bit wire: exact
    q = sum(quantize(p, emax, dcs, bits=16).astype(np.int64) for p in packed)
    wire = (q * 2.0 ** (emax - scale_bits(dcs, 16))).astype(np.float32)
    for total in (wire, np.sum(packed, axis=0, dtype=np.float32)):
        np.testing.assert_array_equal(counts.unpack(total, rows), moved.sum(axis=0))
    assert len(packed[0]) == -(-rows // counts.per)
    assert counts.per == {1: 14, 2: 8, 3: 6, 4: 5, 8: 3, 127: 1}[dcs]


def test_row_counts_beyond_127_data_centres_say_so():
    from switchml.gaia.diloco import RowCounts
    with pytest.raises(ValueError, match="127"):
        RowCounts(128)
