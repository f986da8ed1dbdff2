"""Hierarchical aggregation: a rack switch that is one worker of a parent switch (sans-I/O).

Theory of operation (SwitchML's multi-rack sketch, SHARP's trees). A
:class:`RackAggregator` wraps an ordinary :class:`~switchml.protocol.switch.SwitchDataplane`
(the *inner* switch) that serves the rack's workers, the *children*, in a job of their own.
Upstream it is rank ``rack`` of a *parent* job on a parent (spine) switch, whose ranks are the
racks. Both jobs have the same window ``W`` and chunk size ``k``: child slot ``base_c + i`` maps
to parent slot ``base_p + i``, with the same set, ``seq`` and ``chunk``.

1. A child's REQUEST goes to the inner switch unchanged (every per-slot rule of the flat
   protocol applies in the rack: sets, seen bitmaps, WAITING, MISMATCH, NACK, ...).
2. When the inner switch completes a round, its multicast is intercepted: the partial sum goes
   upstream as one REQUEST (same payload, flags, ``exp_data``, digest; ``exp_next`` = the
   rack's max) with the parent job's id, token, slot and this rack's rank. No
   re-quantisation: the children quantise for the whole tree (``JobSpec.scale_workers`` = all
   workers of the tree), so the racks' integer sums add exactly and cannot overflow.
3. The parent's RESULT (global sums, global max exponent, ORed flags) is rewritten for the
   child job and multicast to every child: that is the children's result.
4. Loss recovery, level 1: a child's retransmission into a round the inner switch completed
   makes it answer with its shadow copy, the *local* partial sum; that answer is replaced by
   the parent's result for that round if the rack has it, and dropped otherwise (the result
   will be multicast when it comes). Level 2: every upstream request not yet answered has a
   retransmission deadline (``rto_s * 2^tries``, capped at ``max_rto_s``); the parent switch
   answers a re-sent request with its stored result, exactly as for a worker; a NACK from
   the parent re-sends at once.
5. Failures become :class:`TreeFailed` events (and :attr:`error`): the parent refuses the JOIN
   or does not answer it, the parent lost the job (``UNKNOWN_JOB``), the racks disagree
   (``MISMATCH``), or an upstream round gets no answer for ``parent_timeout_s`` (the message
   names the racks the parent said it waits for, from its WAITING replies). The children,
   which then get no results, fail on their own operation timeout.

The invariant the flat protocol relies on (no rank more than one round ahead on a slot) holds
upstream too: a rack completes round (s, v) only after every child had the result of
(s, 1 - v), which needed the parent's result of (s, 1 - v).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from switchml.protocol.address import Address, format_address
from switchml.protocol.config import JobSpec, SwitchConfig
from switchml.protocol.errors import ConfigError, WireError
from switchml.protocol.events import Event, JobCreated
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    HEADER,
    ControlInfo,
    Flags,
    Header,
    MessageType,
    pack_join,
    unpack_control_info,
    unpack_header,
    unpack_payload,
)

__all__ = ["RackAggregator", "TreeConfig", "TreeFailed", "UpstreamJoined"]

_REQUEST = int(MessageType.REQUEST)
_RESULT = int(MessageType.RESULT)
_RESENT = int(Flags.RESENT)
# Header tuple fields (wire.HEADER): magic, version, type, flags, set, rank, job, token, seq,
# chunk, slot, count, elem, digest, exp_data, exp_next.
_TYPE, _FLAGS, _SET, _RANK, _JOB, _TOKEN, _SEQ, _CHUNK, _SLOT = 2, 3, 4, 5, 6, 7, 8, 9, 10
_TYPE_OFFSET, _FLAGS_OFFSET = 3, 4  # byte offsets of type and flags in a datagram


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """Upstream loss recovery and failure detection of a rack switch. Times in seconds."""

    rto_s: float = 0.01
    """Retransmission timeout of an upstream request before backoff. Default 10 ms (the
    workers' ``min_rto_s``)."""
    max_rto_s: float = 1.0
    """Cap of the exponential backoff. Default 1 s."""
    parent_timeout_s: float = 10.0
    """An upstream round without an answer for this long is reported as a failure
    (:class:`TreeFailed`). Keep it below the workers' ``op_timeout_s`` so that the rack's
    reason is known before the children fail. Default 10 s."""
    join_timeout_s: float = 10.0
    """JOIN to the parent fails if not answered within this time."""
    join_retry_s: float = 0.2
    """JOIN to the parent is re-sent after this long while unanswered. Default 0.2 s."""
    secret: bytes | None = None
    """The parent switch's secret, needed to create the parent job on a switch that has one."""

    def __post_init__(self) -> None:
        if not 0 < self.rto_s <= self.max_rto_s:
            raise ConfigError(f"expected 0 < rto_s <= max_rto_s, got {self.rto_s}, "
                              f"{self.max_rto_s}")
        if self.parent_timeout_s <= self.max_rto_s:
            raise ConfigError(f"parent_timeout_s ({self.parent_timeout_s}) must exceed "
                              f"max_rto_s ({self.max_rto_s})")
        if not 0 < self.join_retry_s <= self.join_timeout_s:
            raise ConfigError(f"expected 0 < join_retry_s <= join_timeout_s, got "
                              f"{self.join_retry_s}, {self.join_timeout_s}")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"join_timeout_s must be > 0, got {self.join_timeout_s}")


def tree_specs(spec: JobSpec, racks: int) -> tuple[JobSpec, JobSpec]:
    """The parent (spine) and child (rack) jobs of a tree of ``racks`` equal racks for the job
    ``spec`` of all its workers: the parent's ranks are the racks, a rack's ranks are its
    ``spec.num_workers // racks`` workers (global rank g is local rank ``g % that`` of rack
    ``g // that``), both quantise for every worker of the tree."""
    if racks < 1 or spec.num_workers % racks:
        raise ConfigError(f"{spec.num_workers} workers do not split into {racks} equal racks")
    n = spec.num_workers
    common = {"job_id": spec.job_id, "token": spec.token, "window": spec.window,
              "elements_per_packet": spec.elements_per_packet, "scale_workers": n}
    return (JobSpec(num_workers=racks, **common),  # type: ignore[arg-type]
            JobSpec(num_workers=n // racks, **common))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class UpstreamJoined:
    """Rack switch: the parent switch granted the parent job (its slot base)."""

    rack: int
    slot_base: int


@dataclass(frozen=True, slots=True)
class TreeFailed:
    """Rack switch: the tree cannot finish its rounds; ``reason`` says why."""

    rack: int
    reason: str


class _Upstream:
    """One lane's (slot, set) round sent upstream: its request, and the parent's answer."""

    __slots__ = ("key", "request", "sent_at", "due_at", "tries", "result", "first_sent")

    def __init__(self, key: tuple[int, int], request: bytes, now: float, rto: float) -> None:
        self.key = key
        self.request = request
        self.first_sent = now
        self.sent_at = now
        self.due_at = now + rto
        self.tries = 0
        self.result: bytes | None = None  # the parent's result, rewritten for the children


class RackAggregator:
    """A rack switch: a switch to its children, rank ``rack`` of ``parent_spec`` upstream.

    Drive it with the Endpoint contract (``receive_datagram``/``receive_many``,
    ``handle_timer``, then ``datagrams_to_send``, ``next_event``, ``get_timer``). Datagrams
    from ``parent_address`` are the parent's; anything else goes to the inner switch.

    Example::

        rack = RackAggregator(parent_spec=JobSpec(job_id=9, token=t, num_workers=2, window=W,
                                                  elements_per_packet=k, scale_workers=8),
                              child_spec=JobSpec(job_id=9, token=t, num_workers=4, window=W,
                                                 elements_per_packet=k, scale_workers=8),
                              rack=0, parent_address=("spine", 48864))
        rack.join(now)   # JOIN upstream; children JOIN the rack as they would any switch

    Raises:
        ConfigError: the child and parent jobs differ in window or chunk size, the rack index
            is outside the parent job, or the scales differ (they must both allow for every
            worker of the tree).
    """

    def __init__(self, *, parent_spec: JobSpec, child_spec: JobSpec, rack: int,
                 parent_address: Address, config: TreeConfig | None = None,
                 switch_config: SwitchConfig | None = None) -> None:
        if (child_spec.window, child_spec.elements_per_packet) != (
                parent_spec.window, parent_spec.elements_per_packet):
            raise ConfigError(
                f"child and parent jobs must have the same window and elements_per_packet "
                f"(lane i of one is lane i of the other): got {child_spec.window}/"
                f"{child_spec.elements_per_packet} and {parent_spec.window}/"
                f"{parent_spec.elements_per_packet}")
        if not 0 <= rack < parent_spec.num_workers:
            raise ConfigError(f"rack must be in 0..{parent_spec.num_workers - 1} (the parent "
                              f"job's ranks), got {rack}")
        if child_spec.scale_count != parent_spec.scale_count:
            raise ConfigError(
                f"child and parent jobs must quantise for the same number of workers (the "
                f"whole tree's, JobSpec.scale_workers): got {child_spec.scale_count} and "
                f"{parent_spec.scale_count}")
        self.parent_spec = parent_spec
        self.child_spec = child_spec
        self.rack = rack
        self.parent_address = parent_address
        self.config = config or TreeConfig()
        self.switch = SwitchDataplane(switch_config)
        self.error: str | None = None
        self.parent_slot_base: int | None = None
        self.child_slot_base: int | None = None
        self._members: list[Address] = []
        self._up: dict[tuple[int, int], _Upstream] = {}  # (set, lane) -> round upstream
        self._held: list[bytes] = []  # upstream requests completed before the parent JOINED
        self._out: list[tuple[bytes | memoryview, Address]] = []
        self._events: deque[Event | UpstreamJoined | TreeFailed] = deque()
        self._join_at: float | None = None
        self._join_deadline = 0.0
        self._waiting_for: list[int] = []
        self.counters = {"upstream_sent": 0, "upstream_retransmissions": 0,
                         "parent_results": 0, "results_multicast": 0,
                         "results_resent": 0, "resends_dropped": 0, "parent_nacks": 0,
                         "parent_duplicates": 0}

    # -- user commands ------------------------------------------------------------------------

    def join(self, now: float) -> None:
        """Join the parent job as rank ``rack`` (retried until JOINED or ``join_timeout_s``).
        Call ``datagrams_to_send`` afterwards."""
        self._join_deadline = now + self.config.join_timeout_s
        self._send_join(now)

    # -- Endpoint contract --------------------------------------------------------------------

    def receive_datagram(self, data: bytes | bytearray | memoryview, addr: Address,
                         now: float) -> None:
        """Process one datagram (from the parent or a child). Call ``datagrams_to_send``."""
        if addr == self.parent_address:
            self._from_parent(data, now)
            return
        self.switch.receive_datagram(data, addr, now)
        self._collect(now)

    def receive_many(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                     senders: np.ndarray, count: int, address_of: Callable[[int], Address],
                     now: float) -> None:
        """Process a batch (as ``SwitchDataplane.receive_many``): runs of child datagrams go to
        the inner switch in one call each, the parent's one by one, in order."""
        view = memoryview(buf)
        i = 0
        while i < count:
            if address_of(int(senders[i])) == self.parent_address:
                o = int(starts[i])
                self._from_parent(view[o:o + int(lens[i])], now)
                i += 1
                continue
            j = i + 1
            while j < count and address_of(int(senders[j])) != self.parent_address:
                j += 1
            self.switch.receive_many(buf, starts[i:j], lens[i:j], senders[i:j], j - i,
                                     address_of, now)
            self._collect(now)
            i = j

    def handle_timer(self, now: float) -> None:
        """Re-send upstream requests that are due, retry the JOIN, expire leases, and report a
        parent that stopped answering. Call ``datagrams_to_send`` afterwards."""
        if self._join_at is not None and now >= self._join_at:
            if now >= self._join_deadline:
                self._join_at = None
                self._fail(f"parent switch at {self._parent_text} did not answer JOIN for "
                           f"job {self.parent_spec.job_id} within "
                           f"{self.config.join_timeout_s:g} s")
            else:
                self._send_join(now)
        if self.switch.get_timer() is not None and now >= self.switch.get_timer():
            self.switch.handle_timer(now)
            self._collect(now)
        cfg = self.config
        for up in self._up.values():
            if up.result is not None or up.due_at > now:
                continue
            if now - up.first_sent >= cfg.parent_timeout_s and self.error is None:
                racks = f"; it waits for rack(s) {self._waiting_for}" if self._waiting_for \
                    else ""
                self._fail(f"rack {self.rack}: no result from the parent switch at "
                           f"{self._parent_text} for chunk {up.key[1]} of operation "
                           f"{up.key[0]} within {cfg.parent_timeout_s:g} s{racks}")
            self._resend(up, now)

    def get_timer(self) -> float | None:
        """The earliest of: the inner switch's lease timer, upstream retransmissions, the JOIN
        retry."""
        times = [t for t in (self.switch.get_timer(), self._join_at) if t is not None]
        times.extend(up.due_at for up in self._up.values() if up.result is None)
        return min(times) if times else None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes | memoryview, Address]]:
        """Return and forget the datagrams to send, in order (children's and the parent's)."""
        out = self._out
        self._out = []
        return out

    def output_runs(self, now: float
                    ) -> tuple[list[tuple[bytes | memoryview, Address]], dict[Address, list]]:
        """``SwitchDataplane.output_runs``'s contract, so that a UDP switch server can host a
        rack: everything comes as replies in order (no per-destination runs)."""
        return self.datagrams_to_send(now), {}

    def receive_batch(self, buf: np.ndarray, nbytes: int, seg: int, addr: Address,
                      now: float) -> None:
        """A GRO buffer of one sender (``SwitchDataplane.receive_batch``'s contract)."""
        if addr == self.parent_address:
            view = memoryview(buf)
            for o in range(0, nbytes, max(seg, 1)):
                self._from_parent(view[o:min(o + seg, nbytes)], now)
            return
        self.switch.receive_batch(buf, nbytes, seg, addr, now)
        self._collect(now)

    @property
    def allocator(self):  # noqa: ANN201 - the inner switch's SlotAllocator
        """The inner switch's slot pool (what a server reports)."""
        return self.switch.allocator

    def next_event(self) -> Event | UpstreamJoined | TreeFailed | None:
        """The inner switch's events (JobCreated, MemberJoined, ...) and the tree's."""
        self._pull_switch_events()
        return self._events.popleft() if self._events else None

    def _pull_switch_events(self) -> None:
        ev = self.switch.next_event()
        while ev is not None:
            if isinstance(ev, JobCreated) and ev.job_id == self.child_spec.job_id:
                self.child_slot_base = ev.slot_base
            self._events.append(ev)
            ev = self.switch.next_event()

    def stats(self) -> dict[str, object]:
        """The inner switch's counters plus the tree's."""
        return {**self.switch.stats(), "tree": dict(self.counters)}

    # -- children ------------------------------------------------------------------------------

    def _collect(self, now: float) -> None:
        """Take the inner switch's output: completed rounds go upstream instead of to the
        children; shadow-copy answers are replaced by the parent's result."""
        self._pull_switch_events()  # learn the child job's slot base as soon as it exists
        replies, runs = self.switch.output_runs(now)
        for data, addr in replies:
            if len(data) >= HEADER.size and data[_TYPE_OFFSET] == _RESULT:
                self._answer_resend(data, addr)
            else:
                self._out.append((data, addr))
        if not runs:
            return
        if not self._members:
            self._members = list(runs)
        run = next(iter(runs.values()))  # every member gets the same results, in order
        for result in run:
            self._send_upstream(bytes(result), now)

    def _answer_resend(self, data: bytes | memoryview, addr: Address) -> None:
        f = HEADER.unpack_from(data)
        up = self._up.get((f[_SET], f[_SLOT] - (self.child_slot_base or 0)))
        if up is None or up.key != (f[_SEQ], f[_CHUNK]) or up.result is None:
            self.counters["resends_dropped"] += 1  # the multicast will bring the result
            return
        copy = bytearray(up.result)
        copy[_FLAGS_OFFSET] |= _RESENT
        self._out.append((bytes(copy), addr))
        self.counters["results_resent"] += 1

    # -- upstream ------------------------------------------------------------------------------

    @property
    def _parent_text(self) -> str:
        return f"{format_address(self.parent_address)}"

    def _send_upstream(self, local_result: bytes, now: float) -> None:
        """Turn the inner switch's result of a round into this rack's request upstream."""
        if self.parent_slot_base is None:
            self._held.append(local_result)
            return
        f = list(HEADER.unpack_from(local_result))
        lane = f[_SLOT] - (self.child_slot_base or 0)
        key = (f[_SEQ], f[_CHUNK])
        p = self.parent_spec
        f[_TYPE], f[_FLAGS] = _REQUEST, f[_FLAGS] & ~_RESENT
        f[_RANK], f[_JOB], f[_TOKEN] = self.rack, p.job_id, p.token
        f[_SLOT] = self.parent_slot_base + lane
        request = HEADER.pack(*f) + local_result[HEADER.size:]
        self._up[f[_SET], lane] = _Upstream(key, request, now, self.config.rto_s)
        self._out.append((request, self.parent_address))
        self.counters["upstream_sent"] += 1

    def _resend(self, up: _Upstream, now: float) -> None:
        up.tries += 1
        up.sent_at = now
        up.due_at = now + min(self.config.rto_s * 2.0 ** up.tries, self.config.max_rto_s)
        self._out.append((up.request, self.parent_address))
        self.counters["upstream_retransmissions"] += 1

    def _from_parent(self, data: bytes | bytearray | memoryview, now: float) -> None:
        try:
            h = unpack_header(data)
        except WireError:
            return
        p = self.parent_spec
        if h.job != p.job_id or h.token != p.token:
            return
        handler = {MessageType.RESULT: self._handle_result,
                   MessageType.JOINED: self._handle_joined,
                   MessageType.REFUSED: self._handle_refused,
                   MessageType.WAITING: self._handle_waiting,
                   MessageType.NACK: self._handle_nack,
                   MessageType.UNKNOWN_JOB: self._handle_unknown_job,
                   MessageType.MISMATCH: self._handle_mismatch}.get(h.type)
        if handler is not None:
            handler(h, data, now)

    def _handle_result(self, h: Header, data: bytes | bytearray | memoryview,
                       now: float) -> None:
        """The parent's sum of a round: rewrite it for the child job and multicast it."""
        if self.parent_slot_base is None:
            return
        lane = h.slot - self.parent_slot_base
        up = self._up.get((h.set_bit, lane))
        if up is None or up.key != (h.seq, h.chunk):
            self.counters["parent_duplicates"] += 1
            return
        if up.result is not None:
            self.counters["parent_duplicates"] += 1
            return
        f = list(HEADER.unpack_from(data))
        c = self.child_spec
        f[_FLAGS] &= ~_RESENT
        f[_RANK], f[_JOB], f[_TOKEN] = 0, c.job_id, c.token
        f[_SLOT] = (self.child_slot_base or 0) + lane
        result = HEADER.pack(*f) + bytes(data[HEADER.size:])
        up.result = result
        self._waiting_for = []
        self.counters["parent_results"] += 1
        for m in self._members:
            self._out.append((result, m))
        self.counters["results_multicast"] += 1

    def _handle_waiting(self, h: Header, data: bytes | bytearray | memoryview,
                        now: float) -> None:
        bitmap = int.from_bytes(bytes(unpack_payload(data, h)), "little")
        self._waiting_for = [r for r in range(self.parent_spec.num_workers) if bitmap >> r & 1]

    def _handle_nack(self, h: Header, data: bytes | bytearray | memoryview, now: float) -> None:
        """The parent lacks a chunk of ours on that lane: re-send what is outstanding there."""
        if self.parent_slot_base is None:
            return
        self.counters["parent_nacks"] += 1
        lane = h.slot - self.parent_slot_base
        for v in (0, 1):
            up = self._up.get((v, lane))
            if up is not None and up.result is None:
                self._resend(up, now)

    def _handle_joined(self, h: Header, data: bytes | bytearray | memoryview,
                       now: float) -> None:
        if self._join_at is None:
            return
        try:
            info = unpack_control_info(unpack_payload(data, h))
        except WireError:
            return
        self._join_at = None
        self.parent_slot_base = info.slot_base
        self._events.append(UpstreamJoined(self.rack, info.slot_base))
        held, self._held = self._held, []
        for result in held:
            self._send_upstream(result, now)

    def _handle_refused(self, h: Header, data: bytes | bytearray | memoryview,
                        now: float) -> None:
        reason = bytes(unpack_payload(data, h)).decode("utf-8", "replace")
        self._join_at = None
        self._fail(f"rack {self.rack}: parent switch at {self._parent_text} refused JOIN: "
                   f"{reason}")

    def _handle_unknown_job(self, h: Header, data: bytes | bytearray | memoryview,
                            now: float) -> None:
        self._fail(f"rack {self.rack}: the parent switch at {self._parent_text} lost job "
                   f"{self.parent_spec.job_id} (restarted?); the tree cannot continue")

    def _handle_mismatch(self, h: Header, data: bytes | bytearray | memoryview,
                         now: float) -> None:
        self._fail(f"rack {self.rack}: the parent switch at {self._parent_text} reports that "
                   f"the racks disagree about chunk {h.chunk} of operation {h.seq}")

    def _send_join(self, now: float) -> None:
        p = self.parent_spec
        self._out.append((pack_join(job=p.job_id, token=p.token, rank=self.rack,
                                    secret=self.config.secret,
                                    info=ControlInfo(p.num_workers, p.window,
                                                     p.elements_per_packet)),
                          self.parent_address))
        self._join_at = now + self.config.join_retry_s

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
            self._events.append(TreeFailed(self.rack, reason))
