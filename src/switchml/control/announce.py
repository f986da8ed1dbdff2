"""The line a switch process prints once it listens, and how a launcher reads it.

``switchml switch`` writes one line to standard output when its socket is bound::

    switchml switch listening on udp 127.0.0.1:48864
    switchml switch listening on udp 127.0.0.1:48865 (shard 1/2)

Launchers (the torch backend's embedded switch, the sharded switch's supervisor, scripts and
tests) wait for it and take the address from it: this module is that contract, written once.
The line goes out in one write, so that the shards of ``--shards``, which share their
supervisor's standard output, never interleave their lines.
"""

from __future__ import annotations

import re
import sys
from typing import TextIO

from switchml.protocol.address import Address, format_address, parse_address

__all__ = ["LISTENING", "announce", "parse_listening"]

LISTENING = "switchml switch listening on udp"
_LINE = re.compile(rf"{re.escape(LISTENING)} (\S+)(?: \(shard (\d+)/(\d+)\))?\s*$")


def announce(address: Address, shard: tuple[int, int] = (0, 1),
             out: TextIO | None = None) -> None:
    """Write the listening line for ``address`` (and its shard, when sharded), in one write."""
    index, count = shard
    tail = f" (shard {index}/{count})" if count > 1 else ""
    stream = out if out is not None else sys.stdout
    stream.write(f"{LISTENING} {format_address(address)}{tail}\n")
    stream.flush()


def parse_listening(line: str) -> Address | None:
    """The address of a listening line, or None if ``line`` is not one."""
    m = _LINE.match(line.strip())
    if m is None:
        return None
    return parse_address(m.group(1), what="the switch's listening line")
