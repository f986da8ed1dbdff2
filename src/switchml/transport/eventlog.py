"""Structured logs of a switch's events: one ``event=... job=...`` line each.

JOIN refusals are rate limited: anyone can send JOINs, so at most ``burst`` refusal lines per
``window_s`` seconds are written, then a count of the ones suppressed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from switchml.protocol.address import format_address
from switchml.protocol.events import JobCreated, JobRefused, JobRemoved, MemberJoined
from switchml.protocol.tree import TreeFailed, UpstreamJoined

__all__ = ["SwitchEventLog"]

log = logging.getLogger("switchml.transport.udp")


class SwitchEventLog:
    """Write a switch's (or a rack switch's) events to the log.

    ``free_slots``: reads the pool's free slots, reported with job creation and removal.
    """

    def __init__(self, free_slots: Callable[[], int], *, burst: int = 10,
                 window_s: float = 10.0) -> None:
        self._free_slots = free_slots
        self._burst = burst
        self._window_s = window_s
        self._window_start = -window_s
        self._logged = 0
        self._suppressed = 0

    def log(self, ev: object, now: float) -> None:
        """Log one event (``now``: the clock, for the refusal rate limit)."""
        if isinstance(ev, JobCreated):
            log.info("event=job_created job=%d n=%d slots=%d..%d elements_per_packet=%d "
                     "free_slots=%d", ev.job_id, ev.num_workers, ev.slot_base,
                     ev.slot_base + ev.window - 1, ev.elements_per_packet, self._free_slots())
        elif isinstance(ev, MemberJoined):
            log.info("event=member_joined job=%d rank=%d address=%s", ev.job_id, ev.rank,
                     format_address(ev.address))
        elif isinstance(ev, JobRemoved):
            kind = "job_expired" if "lease" in ev.reason else "job_finished"
            log.info("event=%s job=%d reason=%r free_slots=%d", kind, ev.job_id, ev.reason,
                     self._free_slots())
        elif isinstance(ev, TreeFailed):
            log.error("event=tree_failed rack=%d reason=%r", ev.rack, ev.reason)
        elif isinstance(ev, UpstreamJoined):
            log.info("event=upstream_joined rack=%d slot_base=%d", ev.rack, ev.slot_base)
        elif isinstance(ev, JobRefused):
            self._refused(ev, now)

    def _refused(self, ev: JobRefused, now: float) -> None:
        if now - self._window_start > self._window_s:
            if self._suppressed:
                log.warning("event=job_refused_suppressed count=%d", self._suppressed)
            self._window_start, self._logged, self._suppressed = now, 0, 0
        if self._logged < self._burst:
            self._logged += 1
            log.warning("event=job_refused job=%d rank=%d address=%s reason=%r", ev.job_id,
                        ev.rank, format_address(ev.address), ev.reason)
        else:
            self._suppressed += 1
