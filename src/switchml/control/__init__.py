"""Job set-up: create a job's shared spec and pass it to every rank.

How a job comes to life (documented in ``docs/protocol.md``, section Control):

1. One party (a launcher, rank 0, the benchmark) calls :func:`new_job_spec`: a random 32-bit job
   id and a random 64-bit token from the OS CSPRNG, plus n, the window W and the chunk size k.
2. It hands the spec to every rank, e.g. as the string of :func:`encode_job_spec` in an
   environment variable or through torch.distributed's store.
3. Every rank JOINs the switch: JOIN(job, rank, token, n, W, k) draws a challenge, and the
   JOIN that answers it proves a key derived from the switch's secret (``protocol/auth.py``).
   The first proven JOIN creates the job and allocates W slots; later ones must carry the same
   token and geometry. The switch records each rank's address; results go to those addresses.
4. When every rank has sent LEAVE, the job's slots return to the pool.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from switchml.protocol.address import Address
from switchml.protocol.auth import TENANT_SHIFT, tenant_job_id
from switchml.protocol.config import JobSpec, default_window
from switchml.protocol.errors import ConfigError
from switchml.protocol.wire import AUTH_TAG_SIZE, elements_for_mtu
from switchml.transport.sockets import elements_per_packet_for

__all__ = ["decode_job_spec", "encode_job_spec", "new_job_spec"]


ETHERNET_MTU = 1500
"""The MTU a job's chunks fit when nobody says which path they take."""


def new_job_spec(num_workers: int, *, window: int | None = None,
                 elements_per_packet: int | None = None,
                 switch: Address | Sequence[Address] | None = None,
                 quorum: int | None = None, tenant: int | None = None,
                 auth_data: bool = False) -> JobSpec:
    """Return a JobSpec with a fresh random job id and an unguessable token.

    Every rank's datagrams (the numpy ``WorkerClient``'s as the torch backend's) carry
    ``elements_per_packet`` int32 elements, so by default they fit the path without IP
    fragmentation, with the torch backend's rule:

    * ``elements_per_packet`` if given;
    * else, given the ``switch`` the ranks will use (an address, or a sharded switch's shards),
      the MTU of this host's path to it (``transport.sockets.local_mtu``: ``SWITCHML_MTU``,
      else the route's, else 1500): 358 elements at 1500, 2233 at 9000, 16366 on loopback
      (65536: the largest datagram UDP allows);
    * else a 1500-byte Ethernet MTU (358 elements), which fits any Ethernet path.

    Size the job for the rank with the smallest MTU: a launcher on the switch's host sees
    loopback, while its ranks on other hosts may see 1500.

    ``window``: slots in flight per worker; default ``default_window(elements_per_packet)``
    (about 256 KiB in flight: 128 slots for MTU-1500 chunks, 16 for 64 KB datagrams).

    ``quorum``: ``JobSpec.quorum`` (a quorum job's results carry a bitmap of ``ceil(n / 8)``
    bytes after the payload; the chunk sized from an MTU leaves room for it).

    ``auth_data``: ``JobSpec.auth_data`` (its requests and results carry a 16-byte MAC after
    the payload; the chunk sized from an MTU leaves room for it: 354 elements at 1500).

    ``tenant``: draw the id from that tenant's range (``auth.tenant_job_id``), for ranks that
    hold its key (``WorkerConfig.tenant_key``); else from the ids outside every tenant's
    (below 2^31), whose keys derive from the switch's secret.

    Example::

        spec = new_job_spec(2, switch=("127.0.0.1", 48864))   # loopback: 16366 elements
    """
    if elements_per_packet is None:
        trailer = ((num_workers + 7) // 8 if quorum else 0) + (AUTH_TAG_SIZE if auth_data else 0)
        elements_per_packet = (elements_for_mtu(ETHERNET_MTU, trailer=trailer) if switch is None
                               else elements_per_packet_for(switch, trailer=trailer))
    return JobSpec(job_id=new_job_id(tenant), token=secrets.randbits(64),
                   num_workers=num_workers,
                   window=default_window(elements_per_packet) if window is None else window,
                   elements_per_packet=elements_per_packet, quorum=quorum, auth_data=auth_data)


def new_job_id(tenant: int | None = None) -> int:
    """A random job id: of ``tenant``'s range (``auth.tenant_job_id``), or, without one, below
    2^31 (outside every tenant's range: its key derives from the switch's secret)."""
    if tenant is None:
        return secrets.randbits(31)
    return tenant_job_id(tenant, secrets.randbits(TENANT_SHIFT))


def encode_job_spec(spec: JobSpec) -> str:
    """Encode as ``job_id:token:n:window:k`` (hex token), for environment variables, with
    ``:scale_workers`` appended when it is set, then ``:q<quorum>`` when that is, then
    ``:m<quorum_min>:d<deadline in microseconds>`` with a deadline, then ``:a`` for an
    authenticated data plane (``auth_data``)."""
    text = (f"{spec.job_id}:{spec.token:016x}:{spec.num_workers}:{spec.window}:"
            f"{spec.elements_per_packet}")
    if spec.scale_workers is not None:
        text += f":{spec.scale_workers}"
    if spec.quorum is not None:
        text += f":q{spec.quorum}"
    if spec.quorum_deadline_s is not None:
        text += f":m{spec.quorum_min}:d{round(spec.quorum_deadline_s * 1e6)}"
    if spec.auth_data:
        text += ":a"
    return text


def decode_job_spec(text: str) -> JobSpec:
    """Inverse of :func:`encode_job_spec`; raises ConfigError with the reason."""
    parts = text.strip().split(":")
    tagged: dict[str, str] = {}
    while (len(parts) > 5 and parts[-1][:1] in ("q", "m", "d", "a")
           and parts[-1][:1] not in tagged):
        tag = parts.pop()
        tagged[tag[0]] = tag[1:]
    quorum = tagged.get("q")
    if tagged.get("a", "") != "":  # (a typo must not turn the MAC off)
        raise ConfigError(f"bad job spec {text!r}: the tag of an authenticated data plane is "
                          f"':a', got ':a{tagged['a']}'")
    if len(parts) not in (5, 6):
        raise ConfigError(f"expected job_id:token:n:window:k[:scale_workers][:q<quorum>][:a], "
                          f"got {text!r}")
    try:
        job_id, n, window, k = int(parts[0]), int(parts[2]), int(parts[3]), int(parts[4])
        token = int(parts[1], 16)
        scale = int(parts[5]) if len(parts) == 6 else None
        quorum = int(quorum) if quorum is not None else None
        qmin = int(tagged["m"]) if "m" in tagged else None
        deadline = int(tagged["d"]) * 1e-6 if "d" in tagged else None
    except ValueError as exc:
        raise ConfigError(f"bad job spec {text!r}: {exc}") from exc
    return JobSpec(job_id=job_id, token=token, num_workers=n, window=window,
                   elements_per_packet=k, scale_workers=scale, quorum=quorum,
                   quorum_min=qmin, quorum_deadline_s=deadline,
                   auth_data=tagged.get("a") == "")
