"""How a "switchml" group sizes its switch job (rank 0 decides, and shares the spec through an
``Exchange``: the group's store for ``backend._create``, the group's collectives for a DDP hook
on another backend's group, ``hooks.py``):
chunks that fit the smallest MTU of any rank towards the switch, the window, the quorum; and
how many ranks share this machine's cores."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from typing import Any

from switchml import env
from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.protocol.config import JobSpec
from switchml.protocol.errors import ConfigError
from switchml.protocol.wire import AUTH_TAG_SIZE, elements_for_mtu
from switchml.torch.rendezvous import Exchange
from switchml.transport.parallel import choose_threads
from switchml.transport.sockets import local_mtu

__all__ = ["Agreement", "agree_on_job", "job_spec_for_ranks", "local_ranks"]

log = logging.getLogger(__name__)


def job_spec_for_ranks(size: int, mtus: Iterable[int], *, window: int | None = None,
                       elements_per_packet: int | None = None,
                       quorum: int | None = None, quorum_min: int | None = None,
                       quorum_deadline_s: float | None = None,
                       tenant: int | None = None, auth_data: bool = False) -> JobSpec:
    """A new switch job for ``size`` ranks whose MTUs towards the switch are ``mtus``.

    Chunks fit the smallest MTU of any rank (no IP fragmentation on any path), unless
    ``elements_per_packet`` or ``SWITCHML_ELEMENTS_PER_PACKET`` says otherwise; the window is
    ``window``, else ``SWITCHML_WINDOW``, else :func:`switchml.control.new_job_spec`'s default for
    the chunk size. Called by the group's rank 0, which shares the result with the others.
    ``quorum``, ``quorum_min``, ``quorum_deadline_s``: ``JobSpec``'s (with a quorum, chunks
    leave room for the results' bitmap). ``tenant``: the job's id is drawn from its range.
    ``auth_data``: ``JobSpec``'s (chunks leave room for the MAC).
    """
    trailer = ((size + 7) // 8 if quorum else 0) + (AUTH_TAG_SIZE if auth_data else 0)
    k = (elements_per_packet or env.elements_per_packet()
         or elements_for_mtu(min(mtus), trailer=trailer))
    spec = new_job_spec(size, window=window if window is not None else env.window(),
                        elements_per_packet=k, quorum=quorum, tenant=tenant,
                        auth_data=auth_data)
    if quorum_deadline_s is not None:
        spec = dataclasses.replace(spec, quorum_min=quorum_min,
                                   quorum_deadline_s=quorum_deadline_s)
    return spec


def local_ranks(size: int) -> int:
    """The ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; else all of them, the
    cautious guess): the cores are shared among them."""
    return max(1, env.local_world_size() or size)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What a group's ranks agreed on for its switch job (:func:`agree_on_job`)."""

    spec: JobSpec
    half_bits: int | None  # None: the automatic choice per dtype
    threads: int
    failover: str  # SWITCHML_FAILOVER on rank 0: "gloo" or "off"
    failover_probe_s: float


def agree_on_job(exchange: Exchange, switch: Any, *, tenant: int | None = None,
                 one_thread: bool = False, quorum: dict[str, Any] | None = None,
                 window: int | None = None, elements_per_packet: int | None = None,
                 group_settings: bool = True) -> Agreement:
    """What a new group's ranks agree on through ``exchange`` (a collective):

    - the job: rank 0 sizes its chunks to the smallest MTU any rank has towards ``switch``
      (``job_spec_for_ranks``, with ``quorum``'s arguments, ``window``, ``elements_per_packet``
      and ``tenant``);
    - the half-type wire width, the failover and the authenticated data plane
      (``SWITCHML_AUTH_DATA``): rank 0's settings rule the group;
    - the I/O threads: the fewest any rank asks for (every rank must split its job into the
      same parts; ``one_thread``: this rank asks for one).

    ``group_settings``: read rank 0's half-type width and failover (a "switchml" group's);
    False for a DDP hook on another backend's group, which has neither. If rank 0 cannot size
    the job (a wrong setting), every rank raises at once, naming rank 0's reason, instead of
    the others waiting out the group's timeout.
    """
    mtus = exchange.gather("mtu", str(local_mtu(switch)))
    wants = exchange.gather("threads", str(1 if one_thread else (
        choose_threads(switch, requested=env.threads(), local_ranks=local_ranks(exchange.size)))))
    mine, failure = None, None
    if exchange.rank == 0:  # rank 0's settings rule the group (checked here, raising if wrong)
        try:
            spec = job_spec_for_ranks(exchange.size, (int(m) for m in mtus), window=window,
                                      elements_per_packet=elements_per_packet, tenant=tenant,
                                      auth_data=env.auth_data(), **(quorum or {}))
            mine = json.dumps({
                "job": encode_job_spec(spec),
                "half_bits": (env.half_bits() or "auto") if group_settings else "auto",
                "failover": env.failover() if group_settings else "off",
                "failover_probe_s": env.failover_probe_s() if group_settings else 0.0})
        except Exception as exc:  # told to every rank, then raised here
            failure = exc
            mine = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    rules = json.loads(exchange.share("job", mine))
    if "error" in rules:
        if failure is not None:
            raise failure
        raise ConfigError(f"rank 0 could not size the group's switch job: {rules['error']}")
    group_half = str(rules["half_bits"])
    if group_settings and exchange.rank and env.half_bits_text() not in ("", group_half):
        log.warning("switchml rank %d: SWITCHML_HALF_BITS is %r here, but rank 0's (%s) "
                    "rules the group", exchange.rank, env.half_bits_text(), group_half)
    return Agreement(spec=decode_job_spec(rules["job"]),
                     half_bits=None if group_half == "auto" else int(group_half),
                     threads=min(int(w) for w in wants), failover=str(rules["failover"]),
                     failover_probe_s=float(rules["failover_probe_s"]))
