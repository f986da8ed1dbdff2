"""How a "switchml" group sizes its switch job (rank 0 decides, and shares the spec through the
group's store, ``backend._create``; the DDP hook's state through its group, ``hooks.py``):
chunks that fit the smallest MTU of any rank towards the switch, the window, the quorum; and
how many ranks share this machine's cores."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from switchml import env
from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.protocol.config import JobSpec
from switchml.protocol.wire import elements_for_mtu
from switchml.transport.parallel import choose_threads
from switchml.transport.sockets import local_mtu

__all__ = ["agree_on_job", "job_spec_for_ranks", "local_ranks"]

log = logging.getLogger(__name__)


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


def agree_on_job(store: Any, prefix: str, key: str, rank: int, size: int, switch: Any, *,
                 tenant: int | None, one_thread: bool, quorum: dict[str, Any]
                 ) -> tuple[JobSpec, int | None, int]:
    """What a new "switchml" group's ranks agree on through its ``store`` (keys under
    ``prefix``; the job's under ``key``): the job (rank 0 sizes its chunks to the smallest MTU
    any rank has towards ``switch``, with ``quorum``, ``job_spec_for_ranks``'s quorum
    arguments), the half-type wire width and the failover (rank 0's settings rule), and the
    I/O threads (the fewest any rank asks for: every rank must split its job into the same
    parts; ``one_thread``: this rank asks for one). Returns (spec, half bits or None for the
    automatic choice, threads)."""
    store.set(f"{prefix}/mtu/{rank}", str(local_mtu(switch)))
    store.set(f"{prefix}/threads/{rank}", str(1 if one_thread else (
        choose_threads(switch, requested=env.threads(), local_ranks=local_ranks(size)))))
    if rank == 0:  # rank 0's setting rules the group (checked here, raising if wrong)
        store.set(f"{key}/half_bits", str(env.half_bits() or "auto"))
        store.set(f"{key}/failover", env.failover())
        store.set(f"{key}/failover_probe_s", str(env.failover_probe_s()))
        spec = job_spec_for_ranks(size, (
            int(store.get(f"{prefix}/mtu/{r}").decode()) for r in range(size)),
            tenant=tenant, **quorum)
        store.set(key, encode_job_spec(spec))
    else:
        spec = decode_job_spec(store.get(key).decode())
    group_half = store.get(f"{key}/half_bits").decode()
    if rank and env.half_bits_text() not in ("", group_half):
        log.warning("switchml rank %d: SWITCHML_HALF_BITS is %r here, but rank 0's (%s) "
                    "rules the group", rank, env.half_bits_text(), group_half)
    threads = min(int(store.get(f"{prefix}/threads/{r}").decode()) for r in range(size))
    return spec, (None if group_half == "auto" else int(group_half)), threads
