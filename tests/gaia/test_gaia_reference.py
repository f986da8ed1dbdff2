"""Gaia against an independent reference: with significance threshold S = 0 (every update is
significant) and staleness 0 (lockstep), each data centre ends every clock with the same
parameters as synchronous training that applies every data centre's update to the common
model (plain SGD: ``w -= lr * sum_j grad_j(w)``), computed here in one process. A dropped or
duplicated update, or a significance rule that holds back an update, fails it."""

from __future__ import annotations

import threading

import numpy as np
import torch

from switchml.gaia.mirror import Mirror
from switchml.gaia.trainer import GaiaSync

STEPS, LR, DCS = 8, 0.05, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _batches(dc: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(90 + dc)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g))
            for _ in range(STEPS)]


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def test_gaia_with_threshold_zero_and_staleness_zero_is_synchronous_training(free_ports):
    leaders = [("127.0.0.1", p) for p in free_ports(DCS)]
    models = [_model() for _ in range(DCS)]
    per_clock: dict[int, list[np.ndarray]] = {j: [] for j in range(DCS)}
    errors: list[BaseException] = []

    def dc(j: int) -> None:
        try:
            model = models[j]
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            mirror = Mirror(dc=j, leaders=leaders, staleness=0, timeout_s=30).start()
            gaia = GaiaSync(model, mirror=mirror, threshold=0.0, decay=False)
            for x, y in _batches(j):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                gaia.after_step()
                gaia.settle()  # what the next forward pass reads, module by module
                per_clock[j].append(_flat(model))
            mirror.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=dc, args=(j,)) for j in range(DCS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    ref = _model()
    data = [_batches(j) for j in range(DCS)]
    for step in range(STEPS):
        grads = []
        for j in range(DCS):
            ref.zero_grad()
            torch.nn.functional.mse_loss(ref(data[j][step][0]), data[j][step][1]).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= LR * sum(g[i] for g in grads)
        want = _flat(ref)
        for j in range(DCS):
            np.testing.assert_allclose(per_clock[j][step], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"data centre {j}, clock {step + 1}")
