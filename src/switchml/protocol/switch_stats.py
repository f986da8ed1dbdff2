"""What a switch says about itself: counters (``stats``, ``drops``), its live jobs and what each
waits for (``job_states``, for ``switchml top`` and the metrics).

Part of :class:`~switchml.protocol.switch.SwitchDataplane` (a base class of it, as
``switch_control.py`` is).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.config import SwitchConfig
from switchml.protocol.jobs import Job, SlotAllocator, bitmap
from switchml.protocol.wire import ControlInfo

__all__ = ["SwitchStats"]

_KERNEL_DROPS = (("stale", K.SC.STALE), ("bad_slot", K.SC.BAD_SLOT),
                 ("bad_payload", K.SC.BAD_PAYLOAD), ("late_duplicate", K.SC.LATE_DUPLICATE),
                 ("duplicate", K.SC.DUPLICATE), ("bad_mac", K.SC.BAD_MAC))
"""The kernel's drop counters (``kernels.SC``) by the names ``drops`` reports."""


class SwitchStats:
    """Counters and job states of the switch (``SwitchDataplane``'s base class)."""

    config: SwitchConfig
    allocator: SlotAllocator
    packets_in: int
    packets_out: int
    mismatch_sent: int
    challenges_sent: int
    _jobs: dict[int, Job]
    _drops: Counter[str]
    _membership: Counter[str]
    _cnt: np.ndarray

    @property
    def jobs(self) -> dict[int, ControlInfo]:
        """Job id -> geometry of every live job."""
        return {j.job_id: j.info for j in self._jobs.values()}

    @property
    def drops(self) -> Counter[str]:
        """A snapshot of the dropped datagrams by reason (``bad_magic``, ``unknown_job``,
        ``bad_token``, ``stale``, ...)."""
        return K.counter_snapshot(self._drops, self._cnt, _KERNEL_DROPS)

    @property
    def results_multicast(self) -> int:
        return int(self._cnt[K.SC.MULTICAST])

    @property
    def rounds_abandoned(self) -> int:
        return int(self._cnt[K.SC.ABANDONED])

    @property
    def results_resent(self) -> int:
        """Re-sent requests into complete rounds, answered with the stored result."""
        return int(self._cnt[K.SC.RESULTS_RESENT])

    @property
    def waiting_sent(self) -> int:
        return int(self._cnt[K.SC.WAITING_SENT])

    @property
    def nacks_sent(self) -> int:
        return int(self._cnt[K.SC.NACKS])

    @property
    def nacks_needless(self) -> int:
        """Re-sends for a NACK that found their chunk already in (it was reordered)."""
        return int(self._cnt[K.SC.NACKS_NEEDLESS])

    def stats(self) -> dict[str, object]:
        """A snapshot of the counters (for logs, ``switchml stats`` and tests)."""
        return {
            "packets_in": self.packets_in,
            "packets_out": self.packets_out,
            "results_multicast": self.results_multicast,
            "results_resent": self.results_resent,
            "late_contributions": int(self._cnt[K.SC.LATE_ANSWERED]),
            "old_results_answered": int(self._cnt[K.SC.OLD_ANSWERED]),
            "rounds_gone_answered": int(self._cnt[K.SC.ROUNDS_GONE]),
            "rounds_completed_at_deadline": int(self._cnt[K.SC.DEADLINE_COMPLETED]),
            "waiting_sent": self.waiting_sent,
            "mismatch_sent": self.mismatch_sent,
            "nacks_sent": self.nacks_sent,
            "nacks_needless": self.nacks_needless,
            "challenges_sent": self.challenges_sent,
            "rounds_abandoned": self.rounds_abandoned,
            "members_joined": self._membership["members_joined"],
            "members_left": self._membership["members_left"],
            "members_replaced": self._membership["members_replaced"],
            "jobs_expired": self._membership["jobs_expired"],
            "drops": dict(self.drops),
            "jobs": len(self._jobs),
            "slots_in_use": self.config.pool_slots - self.allocator.free_slots,
            "elements_aggregated": {j.job_id: j.elements_aggregated for j in self._jobs.values()},
            "nack_gaps": {j.job_id: int(j.jobv[K.J.NACK_GAP]) for j in self._jobs.values()},
            "memory_bytes": sum(j.memory_bytes() for j in self._jobs.values()),
        }

    def job_states(self, now: float) -> list[dict[str, Any]]:
        """What each live job is doing, for ``switchml top`` and the metrics: its ranks and
        joined members, its open rounds (slot sets holding some contributions and waiting for
        others), and per rank missing from any of them how many it is missing from and how
        long ago it last sent anything (``None``: never)."""
        out = []
        for job in self._jobs.values():
            open_ = (job.st[K.S.SEQ] >= 0) & (job.st[K.S.MISSING] > 0)
            missing: Counter[int] = Counter()
            for v, s in zip(*np.nonzero(open_)):
                absent = job.all_ranks & ~bitmap(job.seen[v, s])
                missing.update(r for r in range(job.num_workers) if absent >> r & 1)
            silent = {r: (None if not np.isfinite(job.heard[r]) else
                          max(0.0, now - float(job.heard[r]))) for r in sorted(missing)}
            out.append({"job": job.job_id, "ranks": job.num_workers,
                        "members": sum(m is not None for m in job.members),
                        "window": job.window, "open_rounds": int(open_.sum()),
                        "quorum": job.quorum or job.num_workers,
                        "elements_aggregated": job.elements_aggregated,
                        "waiting_for": dict(sorted(missing.items())), "silent_s": silent})
        return out

    def job_buffers(self, job_id: int) -> np.ndarray | None:
        """The result buffers ``[set, slot, byte]`` of a live job (a relay reads them)."""
        job = self._jobs.get(job_id)
        return None if job is None else job.bufs
