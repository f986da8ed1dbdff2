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


def _run_dcs(make_outer, steps: int, inner_steps: int, outer_lr: float, momentum: float,
             lr: float = 0.1) -> list[np.ndarray]:
    """Every data centre (a thread) trains its batches with DiLoCo; their final params."""
    models = [_model() for _ in range(DCS)]
    out: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def dc(d: int) -> None:
        try:
            diloco = DiLoCo(models[d], outer=make_outer(d), dcs=DCS, inner_steps=inner_steps,
                            outer_lr=outer_lr, outer_momentum=momentum)
            opt = torch.optim.SGD(models[d].parameters(), lr=lr)
            for x, y in _batches(d, steps):
                opt.zero_grad()
                nn.functional.cross_entropy(models[d](x), y).backward()
                opt.step()
                diloco.after_step()
            out[d] = _flat(models[d])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=dc, args=(d,)) for d in range(DCS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
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
