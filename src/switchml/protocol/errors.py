"""The exception hierarchy: every error switchml raises derives from :class:`SwitchMLError`."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "LocalProtocolError",
    "OperationFailed",
    "RanksDisagree",
    "RoundGone",
    "RemoteProtocolError",
    "SwitchMLError",
    "SwitchUnreachable",
    "TransportError",
    "WireError",
]


class SwitchMLError(Exception):
    """Base class of every switchml error."""


class ConfigError(SwitchMLError, ValueError):
    """A configuration value is invalid ("expected X because Y, got Z")."""


class LocalProtocolError(SwitchMLError):
    """The local user misused the API (wrong dtype, call while busy, call after close)."""


class RemoteProtocolError(SwitchMLError):
    """A peer sent something illegal; internal to the core, which drops and counts such input."""


class WireError(RemoteProtocolError):
    """A datagram could not be decoded; ``reason`` is the drop trigger (e.g. ``"bad_magic"``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class OperationFailed(SwitchMLError):
    """A collective operation could not complete (switch gone, peers silent, job refused)."""


class RanksDisagree(OperationFailed):
    """The ranks issued different operations (another size, dtype kind or bits): a script
    bug, reported by the switch at once (MISMATCH). No failover can help."""


class RoundGone(OperationFailed):
    """A quorum job's rank fell so far behind that a round it waits for completed without it
    and left the switch's history (the switch answered GONE): its result cannot be had
    again. The rank cannot go on in this job; it rejoins with a live rank's state
    (``switchml.torch.live``: under torchrun, exit and be restarted as a replacement)."""


class SwitchUnreachable(OperationFailed):
    """An operation made no progress for ``op_timeout_s`` and the switch said nothing at all
    meanwhile (not a WAITING naming silent ranks): the switch, or the path to it, is gone.
    The torch backend's failover (``SWITCHML_FAILOVER=gloo``) goes on over gloo on this one."""


class TransportError(SwitchMLError):
    """The environment failed: socket error, port in use, process died."""
