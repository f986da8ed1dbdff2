"""The worker's state layout: the one table of the fields its compiled kernels share with
Python (``operation.py`` builds the arrays, ``recovery.py`` the round-trip state), and of
the codes they return.

The compiled data plane (``src/switchml/csrc/worker.c``) reads these as ``#define``s from
``csrc/layout.h``, which :func:`c_header` writes from this module and from ``wire.py``'s
header table (``python -m switchml.protocol.kernels.layout`` rewrites it;
``tests/protocol/test_worker_kernels.py`` checks that the file is what this module makes).
Stdlib only.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["FP", "LF", "LN", "LNF_FIELDS", "LN_FIELDS", "OP", "O_FIELDS", "PROBE_LANES", "R",
           "R_FIELDS", "ST", "WC", "WS", "c_header"]


class OP(IntEnum):
    """Indexes of a worker operation's scalar fields (``opv``, int64)."""

    SEQ = 0
    L = 1  # blocks
    E = 2  # lanes
    T = 3  # packets
    K = 4  # elements per block
    DONE = 5
    JOB = 6
    TOKEN = 7
    RANK = 8
    SLOT_BASE = 9
    ELEM = 10
    ITEMSIZE = 11
    DIGEST = 12
    P = 13  # scale bits
    N = 14  # workers
    IS_FLOAT = 15
    EDGE_EXP = 16  # emax >= this: dequantize near the dtype's range edge
    TAIL_HEAD = 17  # the queue LN.TAIL_ORDER[TAIL_HEAD:TAIL_END] (tail-loss probes)
    TAIL_END = 18
    NQ = 19  # lanes queued to send: ``sendq[:NQ]`` (drained by the endpoint's caller)
    PY_NACKS = 20  # 1: NACKs go to Python (RACK keeps its transmission log there)


O_FIELDS = 21


class R(IntEnum):
    """Indexes of the round-trip estimator and times (``rtt``, float64)."""

    SRTT = 0  # < 0: no sample yet
    RTTVAR = 1
    RTO = 2
    MIN_RTT = 3  # < 0: no sample yet
    MIN_RTO = 4
    MAX_RTO = 5
    LAST_PROGRESS = 6
    LAST_HEARD = 7
    REO_SCALE = 8  # RACK's reorder window, in units of the base window
    DELIVERED_XMIT = 9  # (out) the transmission the last result answered (RACK)
    FMAX = 10  # largest finite value of the output dtype
    MAX_REO_SCALE = 11  # cap of REO_SCALE (WorkerConfig.max_reorder_scale)
    MIN_REO_WINDOW = 12  # WorkerConfig.min_reorder_window_s
    RTO_SRTTS = 13  # WorkerConfig.min_rto_srtts: the timeout is at least this many srtt
    PROBED_AT = 14  # the last idle probe; inf before the operation's last window
    PROBES = 15  # idle probes since the last result (backoff); inf until they are armed


R_FIELDS = 16


class LN(IntEnum):
    """Lane fields (``lane[field, i]``, int64)."""

    CHUNK = 0  # -1: idle
    SET = 1
    XMITS = 2  # transmissions of the current chunk after the first
    TRIES = 3  # timeouts of the current chunk (backoff)
    EMAX = 4  # agreed exponent of the block this lane sends data of next
    FAST = 5  # the current chunk was re-sent by RACK
    SLOT = 6  # the lane's slot on its switch (shard): that shard's slot base + lane
    TAIL_ORDER = 7  # not a lane's field: the lanes in the order they sent their last chunk


class LF(IntEnum):
    """Lane time fields (``lanef[field, i]``, float64)."""

    SENT_AT = 0  # first transmission (RTT samples, Karn's rule)
    XMIT_AT = 1  # latest transmission
    DEADLINE = 2


LN_FIELDS = 8
LNF_FIELDS = 3


class WC(IntEnum):
    """Worker counters (``cnt``, int64)."""

    RESULTS = 0
    PACKETS_SENT = 1
    PAYLOAD_BYTES = 2  # of first transmissions: each chunk's payload once
    RETRANSMISSIONS = 3
    STALE_RESULT = 4
    DUPLICATE_RESULT = 5
    BAD_SLOT = 6
    BAD_COUNT = 7
    SPURIOUS = 8
    PAYLOAD_RESENT = 9  # payload bytes of re-sends (timeouts, probes, NACKs, RACK)
    TAIL_PROBES = 10  # lanes' last chunks whose deadline a tail-loss probe brought forward
    NACK_RESENDS = 11  # chunks re-sent because the switch NACKed their lane
    NACKS_IGNORED = 12  # NACKs answered meanwhile, or for a chunk re-sent under a round trip
    TIMER_RESENDS = 13  # chunks re-sent because their lane's deadline passed
    IDLE_PROBES = 14  # chunks re-sent by the idle probe (``fire_timers``)
    N = 15



class WS(IntEnum):
    """Why :func:`worker_results` stopped."""

    DONE = 0  # every datagram taken
    OTHER = 1  # not a RESULT of this job: Python's path
    OP_COMPLETE = 2  # the operation's last result: Python completes it
    ONE = 3  # took one result (``limit`` reached): RACK runs, then call again
    FULL = 4  # the send queue is full: the endpoint spills it, then calls again



PROBE_LANES = 8
"""Chunks an idle probe re-sends at most: the outstanding ones transmitted longest ago."""


class FP(IntEnum):
    """Why the worker's compiled loop (``transport/fastpath.py``'s ``pump``) returned."""

    WAKE = 0  # a command came (the inbox is readable), or MAX_WAIT_S passed idle
    STOPPED = 1  # the results kernel stopped at datagram ``at`` of the batch: Python goes on
    DUE = 2  # the operation's own timeout passed (no progress for op_timeout_s)
    SEND_FAILED = 3  # a sendmsg failed: the unsent requests are still queued
    RECV_FAILED = 4  # recvmmsg or poll failed (not for want of data): ``stats[ERRNO]``


class ST(IntEnum):
    """Counters the compiled loop adds to (``stats``)."""

    RECV_CALLS = 0
    SEND_CALLS = 1
    DATAGRAMS_SENT = 2
    ERRNO = 3  # the errno of the call that failed (RECV_FAILED, SEND_FAILED); not a counter
    N = 4


def c_header() -> str:
    """``csrc/layout.h``: the wire header's offsets and constants (``wire.py``) and every
    field and code above, as C ``#define``s."""
    from switchml.protocol import wire

    lines = ["/* Generated by `python -m switchml.protocol.kernels.layout` from wire.py and",
             "   protocol/kernels/layout.py: do not edit. */", "#pragma once", ""]

    def put(name: str, value: int) -> None:
        v = int(value)
        lines.append(f"#define {name} ({v})" if v < 0 else f"#define {name} {v}")

    put("HDR", wire.HEADER_SIZE)
    for name, at in wire.AT.items():
        put(f"H_{name.upper()}", at)
    put("MAGIC", wire.MAGIC)
    put("VERSION", wire.VERSION)
    for t in wire.MessageType:
        put(f"T_{t.name}", t)
    for f in wire.Flags:
        if f.name != "NONE":
            put(f"F_{f.name}", f)
    put("KNOWN_FLAGS", wire.KNOWN_FLAGS)
    for e in wire.ElementType:
        put(f"E_{e.name}", e)
    put("EXP_ZERO", wire.EXP_ZERO)
    put("PROBE_LANES", PROBE_LANES)
    for enum, prefix in ((OP, "OP"), (R, "R"), (LN, "LN"), (LF, "LF"), (WC, "WC"), (WS, "WS"),
                         (FP, "FP"), (ST, "ST")):
        lines.append("")
        for m in enum:
            put(f"{prefix}_{m.name}", m)
    lines.append("")
    for name in ("O_FIELDS", "R_FIELDS", "LN_FIELDS", "LNF_FIELDS"):
        put(name, globals()[name])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "csrc" / "layout.h"
    path.write_text(c_header())
    print(f"wrote {path}")
