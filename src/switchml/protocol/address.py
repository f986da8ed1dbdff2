"""Addresses: the one type, parser and formatter every layer uses.

An address is ``(host, port)``, as the socket module takes it. It is written ``HOST:PORT`` in
every log line, error message, environment variable and flag; a sharded switch is a
comma-separated list of them (``SWITCHML_SWITCH=h:48864,h:48865``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from switchml.protocol.errors import ConfigError

__all__ = ["Address", "as_addresses", "format_address", "format_addresses", "parse_address",
           "parse_addresses"]

Address = tuple[str, int]
"""``(host, port)``: a UDP endpoint (a switch, a shard, a worker, a simulated host)."""


def format_address(addr: Address) -> str:
    """``HOST:PORT``, as every error message and log line writes an address."""
    return f"{addr[0]}:{addr[1]}"


def as_addresses(value: Address | Sequence[Address]) -> tuple[Address, ...]:
    """One switch address, or the list of a sharded switch's shards, as a tuple of addresses.

    The one place that tells ``(host, port)`` from a list of them: call it where a user's
    value enters (a constructor's or a public function's argument), so that everything inside
    holds a tuple. Example: ``as_addresses(("h", 1)) == (("h", 1),)``.

    Raises:
        ConfigError: an empty list (no switch at all), or anything else that is not a
            ``(host, port)`` or a list of them (a ``"HOST:PORT"`` string: ``parse_address``).
    """
    if isinstance(value, str):
        raise ConfigError(f"expected a switch address (HOST, PORT), got the string {value!r} "
                          "(parse_address turns HOST:PORT into one)")
    if len(value) and isinstance(value[0], str):
        shards = (value,)
    else:
        shards = tuple(value)
    if not shards:
        raise ConfigError("expected a switch address (HOST, PORT) or a list of a sharded "
                          "switch's shards, got an empty list")
    for a in shards:
        if not (isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str)
                and isinstance(a[1], numbers.Integral) and not isinstance(a[1], bool)
                and 0 <= a[1] <= 65535):
            raise ConfigError(f"expected a switch address (HOST, PORT) with a port 0..65535, "
                              f"got {a!r}")
    return shards  # type: ignore[return-value]


def format_addresses(addrs: Sequence[Address]) -> str:
    """One address as ``HOST:PORT``; several (a sharded switch's shards) as ``shards A, B``."""
    if len(addrs) == 1:
        return format_address(addrs[0])
    return "shards " + ", ".join(format_address(a) for a in addrs)


def parse_address(text: str, *, what: str = "address") -> Address:
    """Parse ``HOST:PORT`` (port 0..65535).

    Raises:
        ConfigError: naming ``what`` (e.g. ``"SWITCHML_SWITCH"``) and the text it got.
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    return host, int(port)


def parse_addresses(text: str, *, what: str = "address") -> list[Address]:
    """Parse ``HOST:PORT[,HOST:PORT...]`` (the shards of a sharded switch), at least one.

    Raises:
        ConfigError: naming ``what`` and the text it got.
    """
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"{what} must be HOST:PORT (or a comma-separated list of a sharded "
                          f"switch's shards), got {text!r}")
    try:
        return [parse_address(p, what=what) for p in parts]
    except ConfigError:
        raise ConfigError(f"{what} must be HOST:PORT (or a comma-separated list of a sharded "
                          f"switch's shards), got {text!r}") from None
