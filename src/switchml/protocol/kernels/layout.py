"""The data plane's state layout: the one table of the fields the compiled kernels share with
Python (a worker's: ``operation.py`` builds the arrays, ``recovery.py`` the round-trip state;
a switch's: ``jobs.py``; a rack's relay: ``tree.py``), and of the codes they return.

The compiled data plane (``src/switchml/csrc/worker.c``) reads these as ``#define``s from
``csrc/layout.h``, which :func:`c_header` writes from this module and from ``wire.py``'s
header table (``python src/switchml/protocol/kernels/layout.py`` rewrites it;
``tests/protocol/test_worker_kernels.py`` checks that the file is what this module makes).
Stdlib only.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "ANSWERED", "FP", "IDLE", "J", "J_FIELDS", "LF", "LN", "LNF_FIELDS", "LN_FIELDS",
    "MAX_BATCH", "OP", "O_FIELDS", "PROBE_LANES", "QUORUM_AHEAD", "R", "RC", "REPLIES_PER_CALL",
    "RV", "RV_FIELDS", "R_FIELDS", "S", "SC", "SENT", "SP", "SS", "ST", "S_FIELDS", "U", "UT",
    "UT_FIELDS", "U_FIELDS", "WC", "WS", "XC", "c_header",
]


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
    TRAILER = 21  # a quorum job's results end in a contributor bitmap of this many bytes; else 0
    AUTH = 22  # 1: the job's data plane is authenticated (requests and results carry a MAC)


O_FIELDS = 23


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
    MAC_K0 = 8  # an authenticated job's data key on the lane's shard, bytes 0-7 (LE, signed)
    MAC_K1 = 9  # ... bytes 8-15


class LF(IntEnum):
    """Lane time fields (``lanef[field, i]``, float64)."""

    SENT_AT = 0  # first transmission (RTT samples, Karn's rule)
    XMIT_AT = 1  # latest transmission
    DEADLINE = 2


LN_FIELDS = 10
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
    LEFT_OUT = 15  # quorum results that do not hold this rank (it was late for the round)
    CLAMPED = 16  # blocks sent clamped: this rank's exponent was left out of the agreed one
    BAD_MAC = 17  # results of an authenticated job whose MAC did not verify (dropped)
    N = 18



class WS(IntEnum):
    """Why :func:`worker_results` stopped."""

    DONE = 0  # every datagram taken
    OTHER = 1  # not a RESULT of this job: Python's path
    OP_COMPLETE = 2  # the operation's last result: Python completes it
    ONE = 3  # took one result (``limit`` reached): RACK runs, then call again
    FULL = 4  # the send queue is full: the endpoint spills it, then calls again



QUORUM_AHEAD = 1024
"""How many operations ahead of its own a quorum job's rank keeps the results of (a rank that
fell behind gets the others' results before it starts those operations: ``worker.py``)."""
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


# -- the switch (``aggregate.py``) and a rack's relay (``relay.py``) -------------------------------

class J(IntEnum):
    """Indexes of a switch job's scalar fields (``jobv``, int64)."""

    JOB = 0
    TOKEN = 1  # stored as the signed reinterpretation of the u64 token
    N = 2
    SLOT_BASE = 3
    WINDOW = 4
    MAX_BYTES = 5  # 4 x elements_per_packet: the payload a slot holds
    MIN_SEQ = 6  # -1: none (no epoch JOIN yet)
    AGGREGATED = 7  # elements aggregated
    NACK_GAP = 8  # chunks a rank may run ahead of a chunk it has not delivered; 0: no NACKs
    NACK_CHUNK = 9  # out: the chunk a NACK names (valid when the kernel stops with SS.NACK)
    NACK_SLOT = 10  # out: its slot, relative to SLOT_BASE
    COMPLETIONS = 11  # rounds completed (stamps S.DONE_AT)
    FLOAT_SEQ = 12  # the last operation seen to be float (its rounds carry exponents)
    NACK_CALM_FROM = 13  # the completion of the last needless NACK (or of the last halving)
    SHARDS = 14  # switch shards the job's lanes are striped over (lane i on shard i mod S)
    NACK_BASE_GAP = 15  # SwitchConfig.nack_gap: where a widened gap returns to
    NACK_CALM = 16  # SwitchConfig.nack_calm: completions without a needless NACK per halving
    NACK_WIDENED_AT = 17  # the completion of the last widening (Python's: once per window)
    LOG_AT_RELEASE = 18  # 1: a relay releases the rounds later (log_releases logs them then)
    NACK_CAP = 19  # SwitchConfig.nack_log_windows x WINDOW: how far a widened gap grows
    MEMBER_TIMEOUT_US = 20  # SwitchConfig.member_timeout_s: a member silent this long is gone
    QUORUM = 21  # JobSpec.quorum: a round completes with this many ranks; 0: all N (no quorum)
    TRAILER = 22  # bytes of the contributor bitmap after a result's payload (quorum jobs; else 0)
    HISTORY = 23  # quorum jobs: earlier rounds kept per slot, in ``bufs[2:]`` (else 0)
    QUORUM_MIN = 24  # quorum jobs with a deadline: a round completes at it with this many
    DEADLINE_US = 25  # ... this long after its first contribution (microseconds; 0: none)
    AUTH = 26  # 1: the job's data plane is authenticated (JobSpec.auth_data)
    MAC_K0 = 27  # its data key, bytes 0-7 (little-endian, signed reinterpretation)
    MAC_K1 = 28  # ... bytes 8-15


J_FIELDS = 29


class S(IntEnum):
    """Indexes of a slot set's fields (``st[field, set, slot]``, int64)."""

    SEQ = 0  # -1: never used
    CHUNK = 1
    COUNT = 2
    ELEM = 3
    FLAGS = 4
    EXP_DATA = 5
    EXP_NEXT = 6
    DIGEST = 7
    MISSING = 8
    DONE_AT = 9  # the job's completion counter when the round completed (NACK ordering)
    HPOS = 10  # (set 0's) quorum jobs: the slot's next history row (``J.HISTORY``)
    OPENED_AT = 11  # the switch's clock, in microseconds, at the round's first contribution


S_FIELDS = 12


class SC(IntEnum):
    """Switch counters (``cnt``, int64)."""

    STALE = 0
    BAD_SLOT = 1
    BAD_PAYLOAD = 2
    LATE_DUPLICATE = 3
    MULTICAST = 4
    ABANDONED = 5
    RESULTS_RESENT = 6  # re-sent requests into complete rounds, answered with the result
    WAITING_SENT = 7  # re-sent requests into open rounds, answered WAITING
    NACKS_NEEDLESS = 8  # re-sends for a NACK that found their chunk already in (reordered)
    DUPLICATE = 9  # re-sent requests into open rounds (dropped: the data is in)
    NACKS = 10  # NACKs written
    LATE_ANSWERED = 11  # first contributions to rounds complete without them (quorum jobs)
    OLD_ANSWERED = 12  # requests of earlier rounds answered from the history (quorum jobs)
    DEADLINE_COMPLETED = 13  # rounds a quorum job's deadline completed with fewer than k
    BAD_MAC = 14  # requests whose MAC did not verify, or whose AUTH flag is not their job's
    ROUNDS_GONE = 15  # re-sends of rounds past a slot's history, answered GONE (quorum jobs)
    N = 16


class SS(IntEnum):
    """Why :func:`switch_requests` stopped."""

    DONE = 0  # every datagram taken
    OTHER = 1  # not a request of a known member of this job, or from before the epoch: Python
    WAITING_CONFLICT = 2  # a retransmission into an open round with refused ranks: Python
    #                       tells the sender (MISMATCH)
    MISMATCH = 3  # the chunk disagrees with the round: Python refuses it
    CONFLICT_ADDED = 4  # added to a round that has refused ranks: Python tells this rank
    REPLIES_FULL = 5  # the replies written fill their buffer: the caller sends them, calls again
    WAITING_GONE = 6  # a retransmission into an open round that waits for a gone rank: Python
    #                   answers WAITING, sealed (a worker fails its operation on it)
    ROUND_GONE = 7  # a quorum job's re-send of a round past the slot's history: Python answers
    #                 GONE, sealed (a worker fails its operation on it)


MAX_BATCH = 4096
"""Datagrams one batch call takes at most (the kernel's GRO merges at most 64; recvmmsg of 64
buffers of up to 64 each)."""
REPLIES_PER_CALL = 64
"""Replies (NACK, RESENT, WAITING datagrams) ``switch_requests`` writes per call: its
``replies`` buffer's rows."""


class RV(IntEnum):
    """A rack's scalars (``rv``, int64)."""

    PARENT_JOB = 0
    PARENT_TOKEN = 1  # the signed reinterpretation of the u64 token
    RACK = 2  # this rack's rank in the parent job
    PARENT_BASE = 3  # the parent's slot base; -1 until JOINED
    CHILD_JOB = 4
    CHILD_TOKEN = 5
    CHILD_BASE = 6  # the child job's slot base on the inner switch; -1 until it exists


RV_FIELDS = 7


class U(IntEnum):
    """An upstream round's state (``ust[field, set, lane]``, int64)."""

    STATE = 0  # 0 idle, 1 sent and unanswered, 2 answered (``down`` holds the result)
    SEQ = 1
    CHUNK = 2
    LEN = 3  # request length
    TRIES = 4  # retransmissions
    RESULT_LEN = 5


U_FIELDS = 6


class UT(IntEnum):
    """An upstream round's times (``utimes[field, set, lane]``, float64)."""

    FIRST_SENT = 0
    DUE = 1  # next retransmission


UT_FIELDS = 2
IDLE, SENT, ANSWERED = 0, 1, 2


class RC(IntEnum):
    """Relay counters (``cnt``, int64)."""

    UPSTREAM_SENT = 0
    PARENT_RESULTS = 1
    PARENT_DUPLICATES = 2
    N = 3



class XC(IntEnum):
    """Counters the switch's result sender adds to (``transport/switchpath.py``'s ``SC``)."""

    SEND_CALLS = 0
    DATAGRAMS_SENT = 1
    BLOCKED = 2  # datagrams a full socket buffer refused (lost: retransmission recovers)
    ERRORS = 3  # datagrams another send error lost
    N = 4


class SP(IntEnum):
    """Counters the switch's compiled loop (``switch_pump``) adds to (beside ``XC``'s)."""

    RECV_CALLS = 0
    TAKEN = 1  # datagrams received and taken by the kernel
    RESULTS = 2  # result datagrams sent (or lost to a full buffer)
    REPLIES = 3  # replies sent (NACK, RESENT, WAITING)
    ERRNO = 4  # the errno of a failed recvmmsg or poll; not a counter
    N = 5


def c_header() -> str:
    """``csrc/layout.h``: the wire header's offsets and constants (``wire.py``) and every
    field and code above, as C ``#define``s."""
    from switchml.protocol import wire

    lines = ["/* Generated by `python src/switchml/protocol/kernels/layout.py` from wire.py and",
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
    put("DATA_TAG", wire.AUTH_TAG_SIZE)
    put("RESULT_FLAGS", wire.RESULT_FLAGS)
    put("REQUEST_FLAGS", wire.REQUEST_FLAGS)
    for e in wire.ElementType:
        put(f"E_{e.name}", e)
    put("EXP_ZERO", wire.EXP_ZERO)
    put("PROBE_LANES", PROBE_LANES)
    put("QUORUM_AHEAD", QUORUM_AHEAD)
    from switchml.protocol.slots import SlotAction

    put("REPLIES_PER_CALL", REPLIES_PER_CALL)
    put("MAX_BATCH", MAX_BATCH)
    for name in ("IDLE", "SENT", "ANSWERED"):
        put(f"U_{name}", globals()[name])
    for enum, prefix in ((OP, "OP"), (R, "R"), (LN, "LN"), (LF, "LF"), (WC, "WC"), (WS, "WS"),
                         (FP, "FP"), (ST, "ST"), (J, "J"), (S, "S"), (SC, "SC"), (SS, "SS"),
                         (SlotAction, "A"), (RV, "RV"), (U, "U"), (UT, "UT"), (RC, "RC"),
                         (XC, "XC"), (SP, "SP")):
        lines.append("")
        for m in enum:
            put(f"{prefix}_{m.name}", m)
    lines.append("")
    for name in ("O_FIELDS", "R_FIELDS", "LN_FIELDS", "LNF_FIELDS", "J_FIELDS", "S_FIELDS",
                 "RV_FIELDS", "U_FIELDS", "UT_FIELDS"):
        put(name, globals()[name])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "csrc" / "layout.h"
    path.write_text(c_header())
    print(f"wrote {path}")
