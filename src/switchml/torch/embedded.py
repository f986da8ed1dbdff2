"""The software switch a rank 0 starts when no ``SWITCHML_SWITCH`` is set: shared by this
process's groups, reference-counted, stopped a grace period after its last group is gone; and
how the ranks of a group find it (:func:`resolve_switch`, over the group's store or its
collectives: ``rendezvous.py``)."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import subprocess
import threading
from typing import Any

from switchml import env, service
from switchml.protocol.address import Address, as_addresses, format_address, parse_address
from switchml.protocol.errors import ConfigError
from switchml.torch.rendezvous import Exchange

__all__ = ["EMBEDDED", "embedded_switch_pid", "release_embedded_switch",
           "resolve_switch", "resolve_switch_over_group", "stop_embedded_switch"]

log = logging.getLogger(__name__)
_SWITCH_GRACE_S = 2.0
_SWITCH_START_S = 30.0  # the embedded switch must say where it listens within this


class _Embedded:
    """The software switch this process started for its groups, shared and reference-counted.

    Each group whose rank 0 is this process acquires it; the last release stops it after a
    grace period (peers may still be collecting their last results); a new group within the
    grace period cancels the stop. It has a random secret, so that only whoever can read the
    group's store can create jobs on it; ranks get the secret through that store, which torch
    does not authenticate (the store is PyTorch's trust boundary: docs/torch.md).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.address: tuple[str, int] | None = None
        self.secret: bytes = b""
        self.users = 0
        self.timer: threading.Timer | None = None

    def acquire(self) -> tuple[tuple[str, int], bytes]:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.users += 1
            assert self.address is not None
            return self.address, self.secret

    def release(self) -> None:
        with self.lock:
            self.users = max(0, self.users - 1)
            if self.users == 0 and self.proc is not None and self.timer is None:
                self.timer = threading.Timer(_SWITCH_GRACE_S, self._stop_if_unused)
                self.timer.daemon = True
                self.timer.start()

    def _start(self) -> None:
        secret = secrets.token_hex(32)
        # ``switchml switch`` in a child process; it announces its address (control.announce)
        # and its log (warnings) goes on to this process's standard error.
        child = service.start_switch_process(
            ["--log-level", "warning", "switch", "--port", "0", "--metrics-port", "0",
             "--stop-on-stdin-eof"],
            environ={**os.environ, "SWITCHML_SECRET": secret}, start_timeout_s=_SWITCH_START_S)
        self.proc, self.secret = child.proc, secret.encode()
        self.address = child.address
        atexit.register(self.stop)
        log.info("started an embedded switch at %s:%d (pid %d)", *self.address, child.proc.pid)

    def _stop_if_unused(self) -> None:
        with self.lock:
            if self.users:  # acquired again while the timer was firing
                return
            # Decide and detach in one critical section: an acquire() after this starts a
            # new switch instead of getting the one being stopped.
            proc, self.proc = self.proc, None
            self.timer = None
        self._terminate(proc)

    def stop(self) -> None:
        """Stop the switch (idempotent); it also exits by itself when this process does."""
        with self.lock:
            proc, self.proc = self.proc, None
            self.timer = None
            self.users = 0
        self._terminate(proc)

    @staticmethod
    def _terminate(proc: subprocess.Popen[str] | None) -> None:
        service.stop_switch_process(proc)  # it exits on EOF, once quiet (at most 5 s)


EMBEDDED = _Embedded()




def stop_embedded_switch() -> None:
    """Stop the switch this process started, if any (idempotent)."""
    EMBEDDED.stop()


def embedded_switch_pid() -> int | None:
    """The process id of the switch this process started, if it is running."""
    proc = EMBEDDED.proc
    return proc.pid if proc is not None and proc.poll() is None else None


def release_embedded_switch() -> None:
    """Release one use of the switch this process started (from :func:`resolve_switch`
    returning True); the last release stops it after a grace period."""
    EMBEDDED.release()


def resolve_switch(exchange: Exchange) -> tuple[tuple[Address, ...], bytes | None, bool]:
    """Find the switch for a group's job: a collective over ``exchange`` (its store, or its own
    collectives), every rank calls it.

    ``SWITCHML_SWITCH`` (and ``SWITCHML_SECRET``) win; otherwise rank 0 acquires this process's
    embedded switch and shares its address and secret with the others.

    Returns:
        (the switch's address or its shards' as a tuple (``as_addresses``), secret, whether
        this call acquired the embedded switch: then call :func:`release_embedded_switch` once
        done with it).
    """
    configured = env.switch_addresses()
    if configured is not None:
        return as_addresses(configured), env.secret(), False
    mine, failure = None, None
    if exchange.rank == 0:
        try:
            address, secret = EMBEDDED.acquire()
            mine = f"{format_address(address)} {secret.hex()}"
        except Exception as exc:  # told to every rank (they would wait out the timeout)
            failure, mine = exc, f"! {type(exc).__name__}: {exc}"
    if failure is not None:
        exchange.share("switch", mine)
        raise failure
    try:
        text = exchange.share("switch", mine)
        if text.startswith("! "):
            raise ConfigError(f"rank 0 could not start the group's switch: {text[2:]}")
        where, secret_hex = text.split(" ")
        switch, secret = parse_address(where, what="the group's switch"), bytes.fromhex(secret_hex)
    except BaseException:
        if exchange.rank == 0:
            EMBEDDED.release()
        raise
    return (switch,), secret, exchange.rank == 0


def resolve_switch_over_group(pg: Any, rank: int) -> tuple[tuple[Address, ...], bytes | None,
                                                             bool]:
    """:func:`resolve_switch` over ``pg``'s own collectives (``rank``: this process's in
    ``pg``, as the group itself says). Kept for callers of the earlier public helper."""
    from switchml.torch.rendezvous import GroupExchange
    return resolve_switch(GroupExchange(pg))
