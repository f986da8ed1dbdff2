"""Compiled per-datagram kernels: the one implementation of every per-packet rule.

The switch and the worker cost too much per datagram as chains of Python statements and numpy
calls (tens of microseconds each: at a 1500-byte MTU a 1 Gbit/s link carries 83,000 datagrams
per second). The rules that run once per datagram live here, as numba functions that take a
whole batch of datagrams (a GRO or recvmmsg batch) and the endpoint's state as numpy arrays,
and work through the batch without returning to Python:

* ``aggregate.py`` (the switch): :func:`switch_requests` validates a REQUEST, checks job, rank,
  epoch and slot, classifies it by the slot table (``slots.py``), aggregates, maxes the
  exponent, completes the round and writes the result header in place; it also finds chunks a
  rank should have delivered (NACKs).
* ``numerics.py``: block exponents, quantization, dequantization (``quantize.py`` explains).
* ``stream.py`` (the worker): :func:`worker_results` takes results (dequantizes into the
  output), updates its lanes and round-trip estimate, and builds the requests they release
  straight into a preallocated transmit buffer (:func:`build_request`, :func:`send_chunk`).
* ``timers.py`` (the worker): :func:`fire_timers` re-sends what the timers call for
  (timeouts, the idle probe).
* ``frames.py``: wire constants, field access, header writing, batches of datagrams.

A kernel stops (returns the index of the datagram) at anything rare that needs Python: control
messages, malformed datagrams, another job in the same buffer, retransmissions to answer,
disagreeing ranks. The Python side (``switch.py``, ``worker.py``) handles that one datagram and
calls the kernel again for the rest, so datagrams are always processed in order and each rule
exists once. With ``NUMBA_DISABLE_JIT=1`` the kernels run as plain Python (for debugging and
coverage; very slow); without numba installed they do too, with a warning.

Numba's cache notices changes to a kernel's own file only, not to the kernels it calls in
another file of this package: ``transport/compiled.py`` clears a module's cache when it or
anything it imports changed (before any kernel is loaded in a process).
"""

from switchml.protocol.kernels.aggregate import (
    J_FIELDS,
    REPLIES_PER_CALL,
    S_FIELDS,
    SC,
    SS,
    J,
    S,
    log_releases,
    plan_result_runs,
    reply_row_bytes,
    switch_requests,
)
from switchml.protocol.kernels.frames import (
    E_BYTES,
    E_INT16,
    E_INT32,
    EXP_ZERO,
    F_HAS_DATA,
    F_HAS_EXP,
    F_NONFINITE,
    F_RESENT,
    HDR,
    KNOWN_FLAGS,
    MAGIC,
    MAX_BATCH,
    T_NACK,
    T_REQUEST,
    T_RESULT,
    T_WAITING,
    VERSION,
    as_buffer,
    counter_snapshot,
    first_foreign,
    gro_segments,
    i16,
    i64,
    request_framing,
    split_gro,
    split_mmsg,
    u16,
    u32,
    write_header,
)
from switchml.protocol.kernels.numerics import (
    block_exponents,
    dequantize_block,
    dequantize_into,
    exponent_of_bits,
    quantize_block,
    quantize_into,
    residual_block,
    residual_into,
)
from switchml.protocol.kernels.stream import (
    LF,
    LN,
    LN_FIELDS,
    LNF_FIELDS,
    O_FIELDS,
    OP,
    R_FIELDS,
    WC,
    WS,
    R,
    build_request,
    mark_nack_resend,
    plan_runs,
    send_chunk,
    send_first,
    take_nack,
    worker_results,
)
from switchml.protocol.kernels.timers import PROBE_LANES, fire_timers, next_deadline, probe_time

__all__ = [
    "EXP_ZERO", "E_BYTES", "E_INT16", "E_INT32", "F_HAS_DATA", "F_HAS_EXP", "F_NONFINITE",
    "F_RESENT", "HDR", "J", "J_FIELDS", "KNOWN_FLAGS", "LF", "LN", "LNF_FIELDS", "LN_FIELDS",
    "MAGIC", "MAX_BATCH", "OP", "O_FIELDS", "PROBE_LANES", "R", "REPLIES_PER_CALL", "R_FIELDS",
    "S", "SC", "SS", "S_FIELDS", "T_NACK", "T_REQUEST", "T_RESULT", "T_WAITING", "VERSION", "WC",
    "WS", "as_buffer",
    "block_exponents", "build_request", "counter_snapshot", "dequantize_block", "dequantize_into",
    "exponent_of_bits", "fire_timers", "first_foreign", "gro_segments", "i16", "i64",
    "log_releases",
    "mark_nack_resend", "next_deadline", "plan_result_runs", "plan_runs", "probe_time",
    "quantize_block", "quantize_into", "reply_row_bytes", "request_framing", "residual_block",
    "residual_into", "send_chunk", "send_first", "split_gro", "split_mmsg", "switch_requests",
    "take_nack", "u16", "u32", "worker_results", "write_header",
]
