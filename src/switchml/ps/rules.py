"""The parameter servers' step rules, without sockets or threads (unit-tested directly).

Synchronous with backup workers (Chen et al., "Revisiting distributed synchronous SGD", used by
TensorFlow's ``SyncReplicasOptimizer``): a shard's step ``t`` takes the gradients of the first
``N - b`` workers that push for ``t``; the step then applies their mean (or sum) and the shard
moves to ``t + 1``. A gradient for a step already applied arrives late and is dropped (counted).
With ``b = 0`` every worker's gradient is used and the gradients are summed in worker order,
not arrival order, so the result does not depend on timing (bit-identical runs).

Asynchronous (Hogwild-style parameter servers, as in DistBelief/TensorFlow's default): every
gradient is applied on arrival; the version counts applied gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from switchml.protocol.errors import ConfigError

__all__ = ["AsyncStepRule", "Decision", "SyncStepRule"]


class Decision(Enum):
    ACCEPTED = "accepted"        # kept for the current step, which still waits for more
    COMPLETED = "completed"      # kept, and the step now has enough: apply it
    DROPPED_LATE = "dropped"     # for a step already applied (a backup worker's straggler)


@dataclass
class SyncStepRule:
    """One shard's synchronous step state: which workers pushed for the current step."""

    workers: int
    backup: int = 0
    step: int = 0
    """The step being collected; it is also the shard's version (steps applied)."""
    pending: dict[int, np.ndarray] = field(default_factory=dict)
    dropped: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.backup < self.workers:
            raise ConfigError(f"backup workers must be in 0..{self.workers - 1} (at least one "
                              f"gradient per step), got {self.backup}")

    @property
    def needed(self) -> int:
        return self.workers - self.backup

    def offer(self, *, worker: int, step: int, grad: np.ndarray) -> Decision:
        """Offer a worker's gradient for ``step``.

        Raises:
            ValueError: a worker out of range, a second push for the same step, or a push for
                a future step (the worker skipped a pull: a protocol violation).
        """
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} out of range 0..{self.workers - 1}")
        if step < self.step:
            self.dropped += 1
            return Decision.DROPPED_LATE
        if step > self.step:
            raise ValueError(f"worker {worker} pushed for step {step} while step {self.step} "
                             "is collected (it must pull first)")
        if worker in self.pending:
            raise ValueError(f"worker {worker} pushed twice for step {step}")
        self.pending[worker] = grad
        return Decision.COMPLETED if len(self.pending) >= self.needed else Decision.ACCEPTED

    def take_sum(self) -> tuple[np.ndarray, list[int]]:
        """The sum of the collected gradients (added in worker order, so the result does not
        depend on arrival order) and who contributed (sorted); moves to the next step. Call
        after :meth:`offer` returned COMPLETED."""
        if len(self.pending) < self.needed:
            raise ValueError(f"step {self.step} has {len(self.pending)} of {self.needed} "
                             "gradients")
        order = sorted(self.pending)
        total = self.pending[order[0]].astype(np.float32, copy=True)
        for w in order[1:]:
            total += self.pending[w]
        self.pending = {}
        self.step += 1
        return total, order


@dataclass
class AsyncStepRule:
    """Asynchronous: every gradient is applied alone, on arrival."""

    workers: int
    step: int = 0
    dropped: int = 0  # always 0: nothing is late without steps
    _last: tuple[np.ndarray, int] = field(default=(np.zeros(0, np.float32), -1), repr=False)

    def offer(self, *, worker: int, step: int, grad: np.ndarray) -> Decision:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} out of range 0..{self.workers - 1}")
        self._last = (grad, worker)
        return Decision.COMPLETED

    def take_sum(self) -> tuple[np.ndarray, list[int]]:
        """The one gradient just offered, and its worker; moves the version on."""
        self.step += 1
        grad, worker = self._last
        return grad, [worker]
