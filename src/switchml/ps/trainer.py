"""PyTorch training through parameter servers: the optimizer step runs on the servers.

Usage in a worker (after ``loss.backward()``, instead of ``optimizer.step()``)::

    trainer = PSTrainer(model, servers=[("10.0.0.5", 40000)], worker=rank, workers=n)
    for x, y in data:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()          # push gradients, pull the servers' new parameters
        if trainer.done(steps): break
    trainer.close()

Synchronous mode: step ``t`` pushes gradients for ``t`` and pulls version ``t + 1``; the
worker's step becomes the smallest version received, so a straggler whose gradient was dropped
(backup workers) skips ahead. Asynchronous mode: push, then pull whatever is current.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from switchml.links import LinkSecurity
from switchml.protocol.errors import ConfigError
from switchml.ps.client import Address, PSClient
from switchml.ps.placement import Shard, format_placement, place

__all__ = ["PSTrainer", "model_digest"]

log = logging.getLogger(__name__)


def model_digest(model: Any) -> str:
    """sha256 of every parameter's bytes, in order (to compare runs bit for bit)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


class PSTrainer:
    """Drive one worker's model through the parameter servers ``servers``."""

    def __init__(self, model: Any, *, servers: Sequence[Address], worker: int, workers: int,
                 mode: str = "sync", max_shard_elements: int = 1 << 20,
                 timeout_s: float = 60.0, print_placement: bool = False,
                 security: LinkSecurity | None = None) -> None:
        """``security``: the servers' TLS credentials (``links.py``; ``PSRole.security``).

        Raises:
            ConfigError: a trainable parameter that is not a contiguous float32 CPU tensor
                (the servers hold float32 shards, read and written in place); named, before
                anything is sent.
        """
        import torch

        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        for name, p in model.named_parameters():
            if p.requires_grad and (p.dtype != torch.float32 or p.device.type != "cpu"
                                    or not p.is_contiguous()):
                raise ConfigError(
                    f"parameter {name!r} is a {'' if p.is_contiguous() else 'non-contiguous '}"
                    f"{str(p.dtype).replace('torch.', '')} tensor on {p.device}: the parameter "
                    "servers train contiguous float32 CPU parameters (model.float().cpu()); "
                    "for CUDA or half-precision models use the switchml torch backend")
        self.shards: list[Shard] = place(
            [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad],
            len(servers), max_shard_elements=max_shard_elements)
        if print_placement:
            print(format_placement(self.shards, len(servers)), flush=True)
        self.mode = mode
        self.step_count = 0
        """Synchronous: the version of the parameters this worker holds (steps applied)."""
        self.iterations = 0
        """Pushes done by this worker."""
        # The servers name missing workers after their own timeout (normally the same
        # value); wait a little longer here, so that their message, not ours, arrives.
        self.client = PSClient(servers, worker=worker, workers=workers,
                               timeout_s=timeout_s + 10.0, security=security)
        self._flat = [p.detach().view(-1).numpy() for p in self.params]
        self._bufs = {s.shard_id: np.empty(s.numel, np.float32) for s in self.shards}
        if worker == 0:
            self.client.init(self.shards, {s.shard_id: self._piece(self._flat, s)
                                           for s in self.shards})
        self._pull(0)

    @staticmethod
    def _piece(flat: list[np.ndarray], s: Shard) -> np.ndarray:
        return flat[s.tensor][s.offset:s.offset + s.numel]

    def _pull(self, version: int) -> None:
        got = self.client.pull(self.shards, version, self._bufs)
        for s in self.shards:
            self._piece(self._flat, s)[:] = self._bufs[s.shard_id]
        self.step_count = got

    def step(self) -> None:
        """Push this worker's gradients and load the servers' parameters.

        Raises:
            PSError: a server died, timed out, or reported a dead worker (named).
        """
        grads = []
        for p in self.params:
            g = p.grad
            grads.append(np.zeros(p.numel(), np.float32) if g is None
                         else g.detach().reshape(-1).numpy())
        self.client.push(self.shards, self.step_count,
                         {s.shard_id: self._piece(grads, s) for s in self.shards})
        self.iterations += 1
        self._pull(self.step_count + 1 if self.mode == "sync" else 0)

    def done(self, steps: int) -> bool:
        """Whether the run is over: ``steps`` versions (sync) or pushes (async)."""
        return (self.step_count if self.mode == "sync" else self.iterations) >= steps

    def stats(self) -> list[dict[str, Any]]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()
