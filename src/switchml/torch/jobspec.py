"""How a "switchml" group sizes its switch job (rank 0 decides, and shares the spec through the
group's store, ``backend._create``; the DDP hook's state through its group, ``hooks.py``):
chunks that fit the smallest MTU of any rank towards the switch, the window, the quorum; and
how many ranks share this machine's cores."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from switchml import env
from switchml.control import new_job_spec
from switchml.protocol.config import JobSpec
from switchml.protocol.wire import elements_for_mtu

__all__ = ["job_spec_for_ranks", "local_ranks"]


def job_spec_for_ranks(size: int, mtus: Iterable[int], *, window: int | None = None,
                       elements_per_packet: int | None = None,
                       quorum: int | None = None, quorum_min: int | None = None,
                       quorum_deadline_s: float | None = None,
                       tenant: int | None = None) -> JobSpec:
    """A new switch job for ``size`` ranks whose MTUs towards the switch are ``mtus``.

    Chunks fit the smallest MTU of any rank (no IP fragmentation on any path), unless
    ``elements_per_packet`` or ``SWITCHML_ELEMENTS_PER_PACKET`` says otherwise; the window is
    ``window``, else ``SWITCHML_WINDOW``, else :func:`switchml.control.new_job_spec`'s default for
    the chunk size. Called by the group's rank 0, which shares the result with the others.
    ``quorum``, ``quorum_min``, ``quorum_deadline_s``: ``JobSpec``'s (with a quorum, chunks
    leave room for the results' bitmap). ``tenant``: the job's id is drawn from its range.
    """
    trailer = (size + 7) // 8 if quorum else 0
    k = (elements_per_packet or env.elements_per_packet()
         or elements_for_mtu(min(mtus), trailer=trailer))
    spec = new_job_spec(size, window=window if window is not None else env.window(),
                        elements_per_packet=k, quorum=quorum, tenant=tenant)
    if quorum_deadline_s is not None:
        spec = dataclasses.replace(spec, quorum_min=quorum_min,
                                   quorum_deadline_s=quorum_deadline_s)
    return spec


def local_ranks(size: int) -> int:
    """The ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; else all of them, the
    cautious guess): the cores are shared among them."""
    return max(1, env.local_world_size() or size)
