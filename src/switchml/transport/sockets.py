"""Socket helpers shared by the switch server and the worker client: buffer sizes, path MTU."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from switchml import env
from switchml.protocol.address import Address, as_addresses, format_address
from switchml.protocol.errors import ConfigError, TransportError
from switchml.protocol.wire import elements_for_mtu

__all__ = ["DEFAULT_PORT", "SOCKET_BUFFER_BYTES", "elements_per_packet_for", "local_mtu",
           "open_worker_socket", "path_mtu", "resolve_ipv4", "size_buffers"]

DEFAULT_PORT = 48864  # 0xBEE0, the P4 switch's UDP port
SOCKET_BUFFER_BYTES = 32 * 2**20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
IP_MTU = getattr(socket, "IP_MTU", 14)  # linux/in.h


def resolve_ipv4(host: str, what: str = "switch") -> str:
    """``host`` (a name or a dotted address) as an IPv4 address: the data plane speaks IPv4.

    Raises:
        ConfigError: it does not resolve (naming it, and ``what`` it was given for)."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"can't resolve the {what} host {host!r} to an IPv4 address "
                          f"({getattr(exc, 'strerror', None) or exc}); give a name or a "
                          "dotted IPv4 address") from None


def resolves_to_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address."""
    import ipaddress
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def path_mtu(address: Address | Sequence[Address]) -> int | None:
    """The MTU of the route towards ``address`` (``IP_MTU`` of a connected UDP socket), or
    None where the platform does not say. Loopback: 65536; an Ethernet path: 1500 (or 9000).
    For the shards of a sharded switch (a list): the smallest."""
    mtus = [m for m in (_route_mtu(a) for a in as_addresses(address)) if m]
    return min(mtus) if mtus else None


def _route_mtu(address: Address) -> int | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(address[0]), int(address[1])))
            return int(s.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except OSError:
        return None


def local_mtu(switch: Address | Sequence[Address]) -> int:
    """This host's MTU towards ``switch`` (an address, or a sharded switch's shards), the rule
    every job sizing uses (the torch backend, its DDP hooks, ``new_job_spec(switch=)``):
    ``SWITCHML_MTU`` (a tunnel, whose route MTU is not the path's), else the route's MTU
    (``path_mtu``: the smallest over the shards), else 1500 (Ethernet)."""
    return env.mtu() or path_mtu(switch) or 1500


def elements_per_packet_for(switch: Address | Sequence[Address], mtu: int | None = None, *,
                            trailer: int = 0) -> int:
    """The chunk size (int32 elements) whose datagrams fit the path to ``switch`` without IP
    fragmentation: from ``mtu`` if given, else from :func:`local_mtu`. Loopback (MTU 65536)
    gives the largest datagram UDP allows (16366 elements); 1500 gives 358, 9000 gives 2233.
    ``trailer``: a quorum job's contributor bitmap after the payload."""
    return elements_for_mtu(mtu or local_mtu(switch), trailer=trailer)


def size_buffers(sock: socket.socket, nbytes: int) -> tuple[int, int]:
    """Grow both socket buffers as far as allowed (SO_*BUFFORCE as root, else capped at
    ``net.core.[rw]mem_max``); return the receive and send sizes the kernel granted."""
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


def open_worker_socket(switches: Sequence[Address], bind_host: str | None,
                       buffer_bytes: int) -> socket.socket:
    """A worker's non-blocking UDP socket: bound on loopback when every switch is there (else
    every interface), connected when there is one switch (that filters other sources and
    surfaces ICMP port unreachable), buffers as large as allowed.

    Raises:
        TransportError: naming the switch and the socket error.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        loopback = all(a[0].startswith("127.") for a in switches)
        sock.bind((bind_host or ("127.0.0.1" if loopback else "0.0.0.0"), 0))
        if len(switches) == 1:
            sock.connect(switches[0])
    except OSError as exc:
        sock.close()
        raise TransportError(f"can't open a socket towards {format_address(switches[0])}: "
                             f"{exc}") from exc
    size_buffers(sock, buffer_bytes)
    sock.setblocking(False)
    return sock
