"""A flight recorder of each switchml group's recent collectives, and the stall watchdog.

Every collective a :class:`~switchml.torch.backend.SwitchMLProcessGroup` issues, through the
switch or delegated to gloo, is a :class:`Record` in a ring of the last ``capacity``: its
sequence number in the group, name, path, element count and dtype, when it started and ended,
and its error. When a rank stalls, the ring says where: the collective it waits in, and the
ones before it (which its peers may not have reached).

* ``switchml.torch.flight_records(group)`` returns the ring; ``dump_flight_records()`` writes
  every group's as JSON lines (to standard error by default).
* A watchdog thread logs, every ``SWITCHML_STALL_LOG_S`` seconds (default 30) that a collective
  stays pending, what this rank waits for: the collective, its size, and the worker's own
  account (the ranks the switch says it waits for, or the switch's silence).
* A failed switch collective logs the error with the last records.
* With ``SWITCHML_FLIGHT_SIGNAL=USR1`` (any signal name), that signal dumps every group's ring.

docs/torch.md, "Finding a stuck rank", says how to use it.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TextIO

__all__ = ["FlightRecorder", "Record", "dump_all", "install_signal", "watch"]

log = logging.getLogger("switchml.torch")


@dataclass
class Record:
    """One collective of a group."""

    seq: int
    op: str
    path: str  # "switch" or "gloo"
    numel: int
    dtype: str
    started: float  # time.time()
    ended: float | None = None
    error: str | None = None

    @property
    def state(self) -> str:
        return "pending" if self.ended is None else ("failed" if self.error else "done")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state}

    def describe(self) -> str:
        return f"collective #{self.seq} {self.op} ({self.numel} x {self.dtype}, via {self.path})"


class FlightRecorder:
    """The ring of one group's last ``capacity`` collectives (thread-safe)."""

    def __init__(self, rank: int, size: int, capacity: int = 256) -> None:
        self.rank, self.size = rank, size
        self._ring: deque[Record] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        self.progress: Callable[[], str | None] = lambda: None
        """The worker's account of an operation in flight (set by the group)."""

    def start(self, op: str, path: str, tensors: Iterable[Any] = ()) -> Record:
        tensors = list(tensors)
        numel = sum(int(t.numel()) for t in tensors)
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors}) or ["-"]
        with self._lock:
            rec = Record(self._seq, op, path, numel, ",".join(dtypes), time.time())
            self._seq += 1
            self._ring.append(rec)
        return rec

    def finish(self, rec: Record, error: BaseException | str | None = None) -> None:
        with self._lock:
            rec.ended = time.time()
            rec.error = None if error is None else str(error)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.as_dict() for r in self._ring]

    def pending(self) -> list[Record]:
        with self._lock:
            return [r for r in self._ring if r.ended is None]

    def summary(self, last: int = 8) -> str:
        """The last ``last`` records, one short line each (for a log line)."""
        with self._lock:
            tail = list(self._ring)[-last:]
        return "; ".join(f"#{r.seq} {r.op} {r.numel}x{r.dtype} {r.path} {r.state}"
                         for r in tail)


_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()  # groups with a ``flight`` recorder
_WATCH: dict[str, Any] = {}


def watch(group: Any, stall_log_s: float) -> None:
    """Add ``group`` (with a ``flight`` attribute) to the watchdog's groups; start the
    watchdog on first use."""
    _GROUPS.add(group)
    if _WATCH.get("thread") is None or not _WATCH["thread"].is_alive():
        _WATCH["interval"] = stall_log_s
        t = threading.Thread(target=_watchdog, name="switchml-watchdog", daemon=True)
        _WATCH["thread"] = t
        t.start()


def _watchdog() -> None:
    logged: dict[tuple[int, int], float] = {}
    while True:
        interval = _WATCH.get("interval", 30.0)
        time.sleep(min(5.0, interval / 2))
        now = time.time()
        for group in list(_GROUPS):
            fr: FlightRecorder = group.flight
            for rec in fr.pending():
                age = now - rec.started
                key = (id(fr), rec.seq)
                if age < interval or now - logged.get(key, 0.0) < interval:
                    continue
                logged[key] = now
                extra = ""
                if rec.path == "switch":
                    try:
                        extra = fr.progress() or ""
                    except Exception as exc:  # noqa: BLE001 - diagnostics must not raise
                        extra = f"(no worker account: {exc})"
                log.warning("switchml rank %d of %d: waiting %.0f s in %s%s; recent: %s",
                            fr.rank, fr.size, age, rec.describe(),
                            f": {extra}" if extra else "", fr.summary())


def dump_all(file: TextIO | None = None) -> None:
    """Every live group's records as JSON lines (``{"rank", "size", **record}``)."""
    out = file or sys.stderr
    for group in list(_GROUPS):
        fr: FlightRecorder = group.flight
        for rec in fr.records():
            out.write(json.dumps({"rank": fr.rank, "size": fr.size, **rec}) + "\n")
    out.flush()


def install_signal(name: str) -> None:
    """Dump every group's records on signal ``name`` (e.g. ``USR1``); from the main thread
    only (Python's rule), else a warning says it was not installed."""
    try:
        signum = getattr(signal, f"SIG{name.upper().removeprefix('SIG')}")
    except AttributeError:
        log.warning("SWITCHML_FLIGHT_SIGNAL=%s: no such signal", name)
        return
    if threading.current_thread() is not threading.main_thread():
        log.warning("SWITCHML_FLIGHT_SIGNAL: not installed (the group was made off the main "
                    "thread)")
        return
    try:
        signal.signal(signum, lambda _s, _f: dump_all())
    except (OSError, ValueError) as exc:  # (KILL and STOP cannot be caught)
        log.warning("SWITCHML_FLIGHT_SIGNAL=%s: cannot be caught (%s)", name, exc)
