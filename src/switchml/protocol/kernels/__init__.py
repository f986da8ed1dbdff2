"""The per-datagram kernels: the one implementation of every per-packet rule, compiled.

The switch and the worker cost too much per datagram as chains of Python statements and numpy
calls (tens of microseconds each: at a 1500-byte MTU a 1 Gbit/s link carries 83,000 datagrams
per second). The rules that run once per datagram are C (``src/switchml/csrc``), built by
``pip install`` into ``switchml._switch`` and ``switchml._worker``; this package exports them
under the names the endpoints call, each taking a whole batch of datagrams and the endpoint's
state as numpy arrays, and working through the batch without returning to Python (and
without the GIL):

* the switch (``csrc/switch.c``): ``switch_requests`` validates a REQUEST, checks job, rank,
  epoch and slot, classifies it by the slot table (``slots.py``), aggregates, maxes the
  exponent, completes the round and writes the result header in place; it also finds chunks
  a rank should have delivered (NACKs) and answers re-sent requests; a rack's relay;
* the worker (``csrc/worker.c``): ``worker_results`` takes results (dequantizes into the
  output), updates its lanes and round-trip estimate, and builds the requests they release
  straight into a preallocated transmit buffer; ``fire_timers`` re-sends what the timers call
  for; the numerics (``quantize.py`` is their public face).

A kernel stops (returns the index of the datagram) at anything rare that needs Python: control
messages, malformed datagrams, another job in the same buffer, disagreeing ranks. The Python
side (``switch.py``, ``worker.py``) handles that one datagram and calls the kernel again for the
rest, so datagrams are always processed in order and each rule exists once in production.

The modules of this package (``aggregate.py`` with ``nacks.py`` and ``bitmaps.py``,
``relay.py``, ``stream.py``, ``numerics.py``, ``timers.py``, ``runs.py``, ``frames.py``) are the
same rules in plain Python: the reference the C is tested against, rule for rule, on crafted,
hostile and random batches and whole lossy jobs (``tests/protocol/test_switch_kernels.py``,
``test_worker_kernels.py``); no endpoint runs them. ``layout.py`` is the one table of the
state's fields and codes, from which ``csrc/layout.h`` is generated.
"""

from switchml.protocol.kernels.aggregate import (
    J_FIELDS,
    REPLIES_PER_CALL,
    S_FIELDS,
    SC,
    SS,
    J,
    S,
    reply_row_bytes,
)
from switchml.protocol.kernels.frames import (
    E_BYTES,
    E_INT16,
    E_INT32,
    EXP_ZERO,
    F_CONTRIBUTORS,
    F_HAS_DATA,
    F_HAS_EXP,
    F_NONFINITE,
    F_RESENT,
    HDR,
    KNOWN_FLAGS,
    MAGIC,
    MAX_BATCH,
    RESULT_FLAGS,
    T_NACK,
    T_REQUEST,
    T_RESULT,
    T_WAITING,
    VERSION,
    as_buffer,
    counter_snapshot,
    i16,
    i64,
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
    QUORUM_AHEAD,
    R_FIELDS,
    U_FIELDS,
    WC,
    WS,
    R,
)
from switchml.protocol.wire import AT


def _load(name: str, want: dict[str, int]):
    """The compiled module ``switchml._<name>`` (from ``src/switchml/csrc/<name>.c``), checked
    against this package's layout (``want``: the constants it must have been built with); a
    clear ImportError where it was not built or was built from another layout."""
    import importlib
    try:
        module = importlib.import_module(f"switchml._{name}")
    except ImportError as exc:
        raise ImportError(
            f"switchml's compiled data plane (switchml._{name}, from src/switchml/csrc/{name}.c)"
            " is not built: install the package with `pip install -e .` (or, after editing the "
            "C source, `python setup.py build_ext --inplace`); it needs a C compiler") from exc
    have = {k: getattr(module, k, None) for k in want}
    if have != want:
        raise ImportError(f"switchml._{name} was built from another layout ({have}; this "
                          f"source has {want}): rebuild it with `pip install -e .`")
    return module


_s = _load("switch", {"J_FIELDS": J_FIELDS, "S_FIELDS": S_FIELDS, "SC_N": int(SC.N),
                       "HDR": HDR, "MAX_BATCH": MAX_BATCH, "U_FIELDS": U_FIELDS})
expire_rounds = _s.expire_rounds
log_releases = _s.log_releases
plan_result_runs = _s.plan_result_runs
relay_down = _s.relay_down
relay_due = _s.relay_due
relay_next_due = _s.relay_next_due
relay_up = _s.relay_up
request_framing = _s.request_framing
data_sealed = _s.data_sealed
switch_requests = _s.switch_requests
del _s

_w = _load("worker", {"O_FIELDS": O_FIELDS, "R_FIELDS": R_FIELDS, "LN_FIELDS": LN_FIELDS,
                       "LNF_FIELDS": LNF_FIELDS, "WC_N": int(WC.N), "HDR": HDR,
                       "H_EXP_NEXT": AT["exp_next"], "PROBE_LANES": PROBE_LANES,
                       "QUORUM_AHEAD": QUORUM_AHEAD})
OpState = _w.OpState
block_exponents = _w.block_exponents
data_mac = _w.data_mac
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
    "F_RESENT", "F_CONTRIBUTORS", "RESULT_FLAGS", "HDR", "J", "J_FIELDS", "KNOWN_FLAGS", "LF",
    "LN", "LNF_FIELDS", "LN_FIELDS", "MAGIC", "MAX_BATCH", "OP", "O_FIELDS", "OpState",
    "PROBE_LANES", "QUORUM_AHEAD", "R", "REPLIES_PER_CALL",
    "R_FIELDS", "S", "SC", "SS", "S_FIELDS", "T_NACK", "T_REQUEST", "T_RESULT", "T_WAITING",
    "VERSION", "WC", "WS", "as_buffer", "block_exponents", "counter_snapshot", "data_mac",
    "data_sealed",
    "dequantize_block", "expire_rounds", "fire_timers", "first_foreign", "gro_segments", "i16",
    "i64",
    "log_releases", "mark_nack_resend", "next_deadline", "plan_result_runs", "plan_runs",
    "probe_time", "quantize_block", "reply_row_bytes", "request_framing", "residual_block",
    "send_chunk", "send_first", "split_gro", "split_mmsg", "switch_requests", "relay_down",
    "relay_due", "relay_next_due", "relay_up", "take_nack", "u16", "u32", "worker_results",
    "write_header",
]
