"""Parameter servers against an independent reference: synchronous training through the
servers equals single-process SGD on the union of the workers' batches (same start, same
data; equal batches, so the servers' mean of the workers' mean gradients is the union's mean
gradient). A dropped or double-counted gradient, or a wrong average, fails it."""

from __future__ import annotations

import threading

import numpy as np
import torch

from switchml.ps import ParameterServer, ServerConfig
from switchml.ps.trainer import PSTrainer

STEPS, BATCH, LR, MOMENTUM = 6, 8, 0.1, 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3))


def _batches(worker: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + worker)
    return [(torch.randn(BATCH, 10, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def test_synchronous_servers_equal_sgd_on_the_union_of_the_batches():
    workers = 3
    models = [_model() for _ in range(workers)]
    servers = [ParameterServer(i, ServerConfig(workers=workers, lr=LR, momentum=MOMENTUM,
                                               timeout_s=30)).start() for i in range(2)]
    out: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            model = models[w]
            trainer = PSTrainer(model, servers=[s.address for s in servers], worker=w,
                                workers=workers, max_shard_elements=200)
            for x, y in _batches(w):
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                trainer.step()
            out[w] = _flat(model)
            trainer.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in servers:
        s.stop()
    assert not errors, errors

    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    data = [_batches(w) for w in range(workers)]
    for step in range(STEPS):
        x = torch.cat([data[w][step][0] for w in range(workers)])
        y = torch.cat([data[w][step][1] for w in range(workers)])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    want = _flat(ref)
    assert not np.allclose(want, _flat(_model()))  # it trained
    for w in range(workers):
        np.testing.assert_allclose(out[w], want, rtol=1e-5, atol=1e-6)


def test_a_model_the_servers_cannot_train_is_refused_by_name_before_anything_is_sent():
    import pytest

    from switchml.protocol.errors import ConfigError
    half = _model().half()
    with pytest.raises(ConfigError, match=r"parameter '0.weight' is a float16 tensor on cpu"):
        PSTrainer(half, servers=[("127.0.0.1", 1)], worker=0, workers=1)
    strided = _model()
    strided[0].weight.data = strided[0].weight.data.t().contiguous().t()
    with pytest.raises(ConfigError, match="non-contiguous float32"):
        PSTrainer(strided, servers=[("127.0.0.1", 1)], worker=0, workers=1)
