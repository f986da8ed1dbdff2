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
    i16,
    i64,
    request_framing,
    split_gro,
    u16,
    u32,
    write_header,
)
from switchml.protocol.kernels.layout import (
    LF,
    LN,
    LN_FIELDS,
    LNF_FIELDS,
    O_FIELDS,
    OP,
    PROBE_LANES,
    R_FIELDS,
    WC,
    WS,
    R,
)
from switchml.protocol.wire import AT


def _load_worker():
    """The worker's compiled data plane (``switchml._worker``), checked against this
    package's layout; a clear ImportError where it was not built or was built from another
    layout."""
    try:
        from switchml import _worker
    except ImportError as exc:
        raise ImportError(
            "switchml's compiled data plane (switchml._worker, from src/switchml/csrc/worker.c) "
            "is not built: install the package with `pip install -e .` (or, after editing the "
            "C source, `python setup.py build_ext --inplace`); it needs a C compiler") from exc
    want = {"O_FIELDS": O_FIELDS, "R_FIELDS": R_FIELDS, "LN_FIELDS": LN_FIELDS,
            "LNF_FIELDS": LNF_FIELDS, "WC_N": int(WC.N), "HDR": HDR,
            "H_EXP_NEXT": AT["exp_next"], "PROBE_LANES": PROBE_LANES}
    have = {k: getattr(_worker, k, None) for k in want}
    if have != want:
        raise ImportError(f"switchml._worker was built from another layout ({have}; this "
                          f"source has {want}): rebuild it with `pip install -e .`")
    return _worker


_w = _load_worker()
block_exponents = _w.block_exponents
dequantize_block = _w.dequantize_block
fire_timers = _w.fire_timers
first_foreign = _w.first_foreign
gro_segments = _w.gro_segments
split_mmsg = _w.split_mmsg
mark_nack_resend = _w.mark_nack_resend
next_deadline = _w.next_deadline
plan_runs = _w.plan_runs
probe_time = _w.probe_time
quantize_block = _w.quantize_block
residual_block = _w.residual_block
send_chunk = _w.send_chunk
send_first = _w.send_first
take_nack = _w.take_nack
worker_results = _w.worker_results
del _w

__all__ = [
    "EXP_ZERO", "E_BYTES", "E_INT16", "E_INT32", "F_HAS_DATA", "F_HAS_EXP", "F_NONFINITE",
    "F_RESENT", "HDR", "J", "J_FIELDS", "KNOWN_FLAGS", "LF", "LN", "LNF_FIELDS", "LN_FIELDS",
    "MAGIC", "MAX_BATCH", "OP", "O_FIELDS", "PROBE_LANES", "R", "REPLIES_PER_CALL", "R_FIELDS",
    "S", "SC", "SS", "S_FIELDS", "T_NACK", "T_REQUEST", "T_RESULT", "T_WAITING", "VERSION", "WC",
    "WS", "as_buffer",
    "block_exponents", "counter_snapshot", "dequantize_block",
    "fire_timers", "first_foreign", "gro_segments", "i16", "i64",
    "log_releases",
    "mark_nack_resend", "next_deadline", "plan_result_runs", "plan_runs", "probe_time",
    "quantize_block", "reply_row_bytes", "request_framing", "residual_block",
    "send_chunk", "send_first", "split_gro", "split_mmsg", "switch_requests",
    "take_nack", "u16", "u32", "worker_results", "write_header",
]
