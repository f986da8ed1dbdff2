"""The "switchml" backend against gloo: the checks of test_torch_backend.py, and the process
body that runs them all in one spawned group (``backend_body``, started by torch_procs.Procs;
importable by spawned children through sys.path, as torch_procs is).

Every check is a function of its own, registered in ``CHECKS`` (name -> check, in the order they
run). A check issues the same collectives on every rank before comparing anything, so one wrong
result does not desynchronise the ranks; a failing check records its message and the run goes
on, and test_torch_backend.py reads each check's outcome in a test of its own.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch_procs import _init

import switchml.torch as stt
from switchml.transport.udp import elements_per_packet_for

R = dist.ReduceOp


# -- numbers: inputs, references, the documented error bound -------------------------------------

# Elements per packet: the backend's default (SWITCHML_ELEMENTS_PER_PACKET unset): as many as
# fit the path MTU towards the embedded switch on loopback.
K = elements_per_packet_for(("127.0.0.1", 48864))
DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64"]
OPS = ["SUM", "AVG"]
SHAPES = ["scalar", "one", "odd1d", "twod", "transposed", "strided"]
ALLREDUCE_CASES = [f"{d}-{o}-{s}" for d, o, s in itertools.product(DTYPES, OPS, SHAPES)]


def scale_bits(n: int, bits: int = 32) -> int:
    return bits - 1 - n.bit_length()




def _torch_dtype(name: str) -> Any:
    return getattr(torch, name)


def make_input(dtype: str, shape: str, rank: int) -> tuple[Any, Any]:
    """``(tensor, base)``: the rank's deterministic input, possibly a non-contiguous view of base.

    Floats mix magnitudes (so blocks have different exponents); the odd 1-D case has an all-zero
    block on every rank. int64 includes values at and near +-2**62 and the int64 limits, so the
    sum wraps modulo 2**64.
    """
    seed = int.from_bytes(hashlib.sha256(f"{dtype}/{shape}/{rank}".encode()).digest()[:4], "big")
    g = torch.Generator().manual_seed(seed)
    sizes = {"scalar": (), "one": (1,), "odd1d": (40_001,), "twod": (123, 77),
             "transposed": (171, 203), "strided": (100_003,)}
    size = sizes[shape]
    numel = math.prod(size)
    td = _torch_dtype(dtype)
    if dtype.startswith("float") or dtype == "bfloat16":
        mag = 2.0 ** torch.randint(-8, 9, (numel,), generator=g).double()
        flat = torch.randn(numel, generator=g, dtype=torch.float64) * mag
        if shape == "odd1d":
            flat[K:2 * K] = 0.0  # a whole block of zeros (exponent EXP_ZERO) on every rank
            if rank == 0:
                flat[2 * K:2 * K + 100] = 0.0
    elif dtype == "int32":
        flat = torch.randint(-2**28, 2**28, (numel,), generator=g, dtype=torch.int64)
    else:
        flat = torch.randint(-2**62, 2**62, (numel,), generator=g, dtype=torch.int64)
        edge = torch.tensor([2**62 - 1, -2**62, 2**63 - 1, -2**63, 2**62 + rank, -1, 0, 1],
                            dtype=torch.int64)
        flat[:min(numel, edge.numel())] = edge[:numel]
    base = flat.to(td).reshape(size)
    if shape == "transposed":
        return base.t(), base
    if shape == "strided":
        return base[1::3], base
    return base, base


def flat64(t: Any) -> Any:
    """Logical (row-major) values of a tensor as a float64 or int64 numpy array."""
    flat = t.reshape(-1)
    if t.is_floating_point():
        return flat.to(torch.float64).numpy().copy()
    return flat.to(torch.int64).numpy().copy()


def half_ulp(dtype: str, v: Any) -> Any:
    """Half a unit in the last place of ``dtype`` at magnitude ``|v|`` (numpy, elementwise)."""
    fi = torch.finfo(_torch_dtype(dtype))
    _, e = np.frexp(np.abs(np.asarray(v, dtype=np.float64)))
    step = np.maximum(np.ldexp(1.0, e - 1), fi.tiny) * fi.eps
    return 0.5 * step


def switch_tolerance(dtype: str, xs: list[Any], average: bool, bits: int | None = None) -> Any:
    """The documented error bound per element (docs/protocol.md section 4), plus rounding.

    Sum: ``n * 0.5 * 2**(emax - P)`` with ``emax`` the block exponent (max over ranks of the
    ``frexp`` exponent of the block's max magnitude, blocks of a packet's elements in logical
    order: K in 32 bits, 2K in 16) and ``P = bits - 1 - bit_length(n)``, plus the rounding of
    the result to the dtype (bfloat16 is staged as float32 and is rounded twice: to float32,
    then to bfloat16). AVG divides the rounded sum and rounds once more. ``bits``: on the wire
    (None: the backend's rule for the dtype and n, ``backend.wire_bits``).
    """
    n = len(xs)
    numel = xs[0].size
    bits = bits or stt.backend.wire_bits(_torch_dtype(dtype), n)
    k = K * 32 // bits
    bound = np.zeros(numel)
    for b0 in range(0, max(numel, 1), k):
        m = max(float(np.max(np.abs(x[b0:b0 + k]))) if numel else 0.0 for x in xs)
        if m == 0.0:
            continue
        emax = math.frexp(m)[1]
        bound[b0:b0 + k] = n * 0.5 * math.ldexp(1.0, emax - scale_bits(n, bits))
    total = np.abs(np.sum(xs, axis=0)) + bound  # |sum| can be at most this before rounding
    rnd = half_ulp(dtype, total)
    if dtype == "bfloat16":
        rnd = rnd + half_ulp("float32", total)
    if not average:
        return bound + rnd
    return (bound + rnd) / n + half_ulp(dtype, total / n + rnd / n)


def gloo_tolerance(dtype: str, xs: list[Any], average: bool) -> Any:
    """How far gloo's sum, in the dtype, may be from the exact one: n - 1 roundings."""
    n = len(xs)
    mag = np.sum(np.abs(xs), axis=0)
    tol = (n - 1) * half_ulp(dtype, mag)
    if dtype == "bfloat16":
        tol = tol + (n - 1) * half_ulp("float32", mag)  # gloo may accumulate via float
    if average:
        tol = tol / n + half_ulp(dtype, mag / n)
    return tol


def int_reference(xs: list[Any], average: bool, n: int) -> Any:
    """Exact integer sum modulo 2**64, then (AVG) truncating division; Python ints throughout."""
    total = [sum(int(x[i]) for x in xs) for i in range(xs[0].size)]
    wrapped = [(v + 2**63) % 2**64 - 2**63 for v in total]
    if average:
        wrapped = [abs(v) // n * (1 if v >= 0 else -1) for v in wrapped]
    return np.array(wrapped, dtype=np.int64).reshape(xs[0].shape)


def int_wrap(dtype: str, arr: Any) -> Any:
    return arr.astype(np.int32) if dtype == "int32" else arr


# -- the checks --------------------------------------------------------------------------------

@dataclass
class Group:
    """What every check gets: this rank, the group's size, a gloo group over the same ranks
    (the reference), and what the all_reduce cases leave for later checks and the report."""

    rank: int
    world: int
    gloo: Any
    digests: dict[str, str] = field(default_factory=dict)  # case -> sha256 of the result
    margins: dict[str, float] = field(default_factory=dict)  # max error / bound per float case


Check = Callable[[Group], None]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    """Register a check under ``name`` (it runs after the ones registered before it)."""
    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn
    return register


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def _delegated() -> dict[str, int]:
    return dict(stt.stats()["delegated"])


def _switch_ops() -> int:
    return int(stt.stats()["switch_ops"].get("allreduce", 0))


# -- all_reduce: dtype x op x shape against gloo and the exact sum with the bound ----------------

def allreduce_case(g: Group, case: str) -> None:
    """In place, through the switch (one switch op), dtype and shape kept; exact for ints,
    within the documented bound for floats; against gloo."""
    dtype, opname, shape = case.split("-")
    average = opname == "AVG"
    x, base = make_input(dtype, shape, g.rank)
    base_before = base.clone()
    xs = [flat64(make_input(dtype, shape, r)[0]) for r in range(g.world)]
    mine = x.clone().contiguous()
    ptr, storage = x.data_ptr(), base.untyped_storage().data_ptr()
    before = _switch_ops()
    ret = dist.all_reduce(x, op=getattr(R, opname))
    after = _switch_ops()
    gloo = mine.clone()
    dist.all_reduce(gloo, op=R.SUM, group=g.gloo)
    got = flat64(x)
    g.digests[case] = hashlib.sha256(got.tobytes()).hexdigest()
    _expect(ret is None, f"sync all_reduce returned {ret!r}")
    _expect(after == before + 1, f"not through the switch: switch_ops {before}->{after}")
    _expect(x.data_ptr() == ptr and base.untyped_storage().data_ptr() == storage,
            "not in place: the tensor's storage moved")
    _expect(x.dtype == _torch_dtype(dtype) and x.shape == mine.shape,
            f"dtype/shape changed: {x.dtype} {tuple(x.shape)}")
    if shape == "strided":  # the elements between the view's must be untouched
        keep = torch.ones(base.numel(), dtype=torch.bool)
        keep[1::3] = False
        _expect(torch.equal(base[keep], base_before[keep]),
                "elements outside the strided view changed")
    if shape == "transposed":
        _expect(torch.equal(base, x.t()), "base and transposed view disagree")
    if dtype.startswith("int"):
        _expect_int_sum(dtype, average, got, xs, flat64(gloo), g.world)
    else:
        _expect_float_sum(g, case, got, xs, gloo)


def _expect_int_sum(dtype: str, average: bool, got: Any, xs: list[Any], gsum: Any,
                    world: int) -> None:
    """Exact: the wrapped integer sum (AVG: truncated), and what gloo gives."""
    ref = int_wrap(dtype, int_reference(xs, average, world))
    exp_gloo = gsum if not average else int_reference([gsum], True, world)
    bad = np.flatnonzero(got != ref)
    _expect(bad.size == 0, f"{bad.size} wrong elements, first at {bad[:3]}: got "
            f"{got[bad[:3]]}, exact {ref[bad[:3]]}")
    bad = np.flatnonzero(got != exp_gloo)
    _expect(bad.size == 0, f"{bad.size} elements differ from gloo, first at "
            f"{bad[:3]}: got {got[bad[:3]]}, gloo {exp_gloo[bad[:3]]}")


def _expect_float_sum(g: Group, case: str, got: Any, xs: list[Any], gloo: Any) -> None:
    """Within the documented bound of the exact sum, and of gloo's (plus gloo's roundings)."""
    dtype, opname, _shape = case.split("-")
    average = opname == "AVG"
    exact = np.sum(xs, axis=0)
    if average:
        exact = exact / g.world
    tol = switch_tolerance(dtype, xs, average)
    tol = tol + np.abs(exact) * 2.0**-50  # the float64 reference's own rounding
    err = np.abs(got - exact)
    g.margins[case] = float(np.max(err / tol, initial=0.0))
    bad = np.flatnonzero(~(err <= tol))
    _expect(bad.size == 0, f"{bad.size} elements beyond the documented bound, first at "
            f"{bad[:3]}: got {got[bad[:3]]}, exact {exact[bad[:3]]}, err {err[bad[:3]]}, "
            f"bound {tol[bad[:3]]}")
    if average:
        gref = flat64(gloo.div(g.world))
    else:
        gref = flat64(gloo)
    gtol = tol + gloo_tolerance(dtype, xs, average)
    gerr = np.abs(got - gref)
    bad = np.flatnonzero(~(gerr <= gtol))
    _expect(bad.size == 0, f"{bad.size} elements differ from gloo beyond the bound, "
            f"first at {bad[:3]}: got {got[bad[:3]]}, gloo {gref[bad[:3]]}")


for _case in ALLREDUCE_CASES:
    CHECKS[f"allreduce[{_case}]"] = functools.partial(allreduce_case, case=_case)


@check("half_precision_bytes_and_bits")
def half_precision_bytes(g: Group) -> None:
    """float16 and bfloat16 travel in half float32's bytes (16-bit fixed point), as gloo
    moves them; a group made with ``SWITCHML_HALF_BITS=32`` on rank 0 only sends them in 32
    bits on every rank (rank 0's setting reaches the others through the store), float32's
    bytes, with the 32-bit bound."""
    import os

    def sent(group: Any, t: Any) -> int:
        before = stt.stats(group)["worker"].get("payload_bytes_sent", 0)  # (0: not listed)
        dist.all_reduce(t, group=group)
        return stt.stats(group)["worker"]["payload_bytes_sent"] - before

    n = 100_000
    f32 = sent(None, torch.ones(n))
    for dt in (torch.float16, torch.bfloat16):
        got = sent(None, torch.ones(n, dtype=dt))
        _expect(2 * got == f32, f"{dt}: {got} payload bytes, float32 {f32}: not half")
    if g.rank == 0:
        os.environ["SWITCHML_HALF_BITS"] = "32"
    try:
        wide = dist.new_group(backend="switchml")
    finally:
        os.environ.pop("SWITCHML_HALF_BITS", None)
    try:
        _expect(sent(wide, torch.ones(n, dtype=torch.float16)) == sent(wide, torch.ones(n)),
                "SWITCHML_HALF_BITS=32: float16 did not travel as float32's bytes")
        x, _ = make_input("float16", "odd1d", g.rank)
        xs = [flat64(make_input("float16", "odd1d", r)[0]) for r in range(g.world)]
        dist.all_reduce(x, group=wide)
        tol32 = switch_tolerance("float16", xs, False, bits=32)
        err = np.abs(flat64(x) - np.sum(xs, axis=0))
        _expect(bool(np.all(err <= tol32)), "32-bit float16 beyond the 32-bit bound")
    finally:
        dist.destroy_process_group(wide)


@check("allreduce_bucket_bits_and_residual")
def bucket_bits_and_residual(g: Group) -> None:
    """``allreduce_bucket`` (the DDP hooks' path on a switchml group): 16 bits on the wire
    (half float32's payload bytes), the sum within the 16-bit bound of the exact sum, and the
    residual written: the input less what this rank's 16-bit fixed point sent (nonzero); a
    wrong argument is refused by name."""
    pg = dist.distributed_c10d._get_default_group()
    xs = [flat64(make_input("float32", "odd1d", r)[0]) for r in range(g.world)]
    x = make_input("float32", "odd1d", g.rank)[0].reshape(-1).contiguous()
    mine = x.clone()
    residual = torch.zeros_like(x)
    before = stt.stats()["worker"].get("payload_bytes_sent", 0)
    pg.allreduce_bucket(x, bits=16, residual=residual).wait()
    sent = stt.stats()["worker"]["payload_bytes_sent"] - before
    _expect(sent * 2 <= x.numel() * 4 + 64 * 4, f"{sent} payload bytes for {x.numel()} "
            "float32 in 16 bits: not half")
    err = np.abs(flat64(x) - np.sum(xs, axis=0))
    _expect(bool(np.all(err <= switch_tolerance("float32", xs, False, bits=16))),
            "16-bit bucket beyond the 16-bit bound")
    _expect(bool(residual.abs().max() > 0), "no residual written")
    # 32 bits (the 32-bit hook's), no residual: float32's payload, the 32-bit bound
    wide = make_input("float32", "odd1d", g.rank)[0].reshape(-1).contiguous()
    before = stt.stats()["worker"]["payload_bytes_sent"]
    pg.allreduce_bucket(wide, bits=32).wait()
    sent32 = stt.stats()["worker"]["payload_bytes_sent"] - before
    _expect(sent32 >= 2 * sent - 64 * 4, f"{sent32} payload bytes in 32 bits, {sent} in 16")
    err = np.abs(flat64(wide) - np.sum(xs, axis=0))
    _expect(bool(np.all(err <= switch_tolerance("float32", xs, False, bits=32))),
            "32-bit bucket beyond the 32-bit bound")
    # the residual is what rounding took: at most half a 16-bit step of the block's scale
    _expect(bool(np.all(np.abs(flat64(residual)) <= switch_tolerance(
        "float32", [flat64(mine)] * g.world, False, bits=16))), "residual beyond a rounding")
    for bad, what in ((dict(bucket=torch.ones(3, dtype=torch.float64), bits=16), "float32"),
                      (dict(bucket=torch.ones(3), bits=8), "bits must be 32 or 16"),
                      (dict(bucket=torch.ones(3), bits=16, residual=torch.ones(4)),
                       "residual must be")):
        try:
            pg.allreduce_bucket(**bad)
        except ValueError as exc:
            _expect(what in str(exc), f"{bad}: {exc}")
        else:
            raise AssertionError(f"{bad} accepted")


@check("allreduce_bitwise_same_on_all_ranks")
def same_on_all_ranks(g: Group) -> None:
    everyone: list[Any] = [None] * g.world
    dist.all_gather_object(everyone, g.digests, group=g.gloo)
    for case in ALLREDUCE_CASES:
        vals = {d.get(case) for d in everyone}
        _expect(len(vals) == 1, f"{case}: ranks got different results")


@check("complex64_sum")
def complex_sum(g: Group) -> None:
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(50, generator=gen, dtype=torch.complex64) for _ in range(g.world)]
    x = xs[g.rank].clone()
    dist.all_reduce(x)
    exact = sum(t.to(torch.complex128) for t in xs)
    _expect(torch.allclose(x.to(torch.complex128), exact, rtol=0, atol=1e-5),
            f"complex64 sum wrong: {x[:3]} vs {exact[:3]}")


# -- async_op and the Work/Future API -------------------------------------------------------------

@check("async_op_work_and_future")
def async_work(g: Group) -> None:
    x = torch.full((100_003,), float(g.rank + 1))
    before = _switch_ops()
    work = dist.all_reduce(x, async_op=True)
    ok = work.wait()
    fut_value = work.get_future().wait()
    _expect(_switch_ops() == before + 1, "async all_reduce did not go through the switch")
    _expect(ok is True, f"wait() returned {ok!r}")
    _expect(work.is_completed() and work.is_success(), "completed work not completed")
    _expect(isinstance(fut_value, list) and len(fut_value) == 1 and fut_value[0] is x,
            f"future value is not [x]: {type(fut_value)}")
    _expect(torch.equal(x, torch.full((100_003,), 6.0)), f"async result wrong: {x[:3]}")
    # int64 too, with AVG: the future fires after the limbs were put back and divided.
    y = torch.full((5,), 10 * (g.rank + 1), dtype=torch.int64)
    fut_value = dist.all_reduce(y, op=R.AVG, async_op=True).get_future().wait()
    _expect(fut_value[0] is y and torch.equal(y, torch.full((5,), 20, dtype=torch.int64)),
            f"async int64 AVG wrong: {y}")


@check("all_reduce_coalesced")
def coalesced(g: Group) -> None:
    rank, world = g.rank, g.world
    a = torch.arange(40_001, dtype=torch.float32) * (rank + 1)
    b = torch.full((3, 5), 2.0 * (rank + 1))
    c = torch.arange(24, dtype=torch.float32).reshape(4, 6).t() * (rank + 1)  # non-contig.
    ta, tb, tc = a.clone(), b.clone(), c.clone()
    before = _switch_ops()
    ret = dist.all_reduce_coalesced([ta, tb, tc])
    _expect(ret is None, f"sync all_reduce_coalesced returned {ret!r}")
    _expect(_switch_ops() > before, "coalesced all-reduce did not go through the switch")
    s = sum(range(1, world + 1))
    for name, got, src in (("a", ta, a), ("b", tb, b), ("c", tc, c)):
        exact = src.double() / (rank + 1) * s
        _expect(torch.equal(got.double(), exact), f"coalesced {name} wrong")
    # int64, AVG, async: returns a future (torch's all_reduce_coalesced API)
    i1 = torch.tensor([2**62, -(2**62), 7], dtype=torch.int64) + rank
    i2 = torch.full((2, 2), 3 * rank, dtype=torch.int64)
    fut = dist.all_reduce_coalesced([i1, i2], op=R.AVG, async_op=True)
    fut.wait()
    exp1 = torch.tensor(
        [int_reference([np.array([2**62 + r]) for r in range(world)], True, world)[0],
         int_reference([np.array([-(2**62) + r]) for r in range(world)], True, world)[0],
         (21 + 3) // 3], dtype=torch.int64)
    _expect(torch.equal(i1, exp1), f"coalesced int64 AVG wrong: {i1} vs {exp1}")
    _expect(torch.equal(i2, torch.full((2, 2), 3, dtype=torch.int64)),
            f"coalesced int64 AVG wrong: {i2}")


# -- ops and dtypes the switch does not do: delegated to gloo, counted ----------------------------

@check("min_max_product_delegated_and_counted")
def delegated_ops(g: Group) -> None:
    problems = []
    for opname, fn in (("MIN", min), ("MAX", max), ("PRODUCT", math.prod)):
        for dtype in ("float32", "int64"):
            vals = [[(r + 1) * (-1) ** (i + r) * (i + 1) for i in range(7)]
                    for r in range(g.world)]
            x = torch.tensor(vals[g.rank], dtype=_torch_dtype(dtype))
            d0, s0 = _delegated(), _switch_ops()
            dist.all_reduce(x, op=getattr(R, opname))
            d1, s1 = _delegated(), _switch_ops()
            key = f"allreduce:{opname}"
            exp = torch.tensor([fn(v[i] for v in vals) for i in range(7)],
                               dtype=_torch_dtype(dtype))
            if not torch.equal(x, exp):
                problems.append(f"{opname} {dtype}: {x.tolist()} != {exp.tolist()}")
            if d1.get(key, 0) != d0.get(key, 0) + 1:
                problems.append(f"{opname} {dtype}: delegated[{key!r}] "
                                f"{d0.get(key, 0)} -> {d1.get(key, 0)}")
            if s1 != s0:
                problems.append(f"{opname} {dtype}: counted as a switch op too")
    # SUM of a dtype the switch does not carry (uint8) is delegated too
    x = torch.full((9,), g.rank + 1, dtype=torch.uint8)
    d0 = _delegated()
    dist.all_reduce(x)
    d1 = _delegated()
    if not torch.equal(x, torch.full((9,), 6, dtype=torch.uint8)):
        problems.append(f"uint8 SUM: {x.tolist()}")
    if d1.get("allreduce:SUM", 0) != d0.get("allreduce:SUM", 0) + 1:
        problems.append(f"uint8 SUM not counted as delegated: {d0} -> {d1}")
    _expect(not problems, "; ".join(problems))


# -- the other collectives (gloo underneath), counted ---------------------------------------------

@check("other_collectives_delegated")
def collectives(g: Group) -> None:
    problems: list[str] = []
    d0 = _delegated()
    _broadcast_and_gathers(g, problems)
    _reduce_scatters(g, problems)
    _barrier_and_point_to_point(g, problems)
    _all_to_all_and_objects(g, problems)
    d1 = _delegated()
    # all_gather_into_tensor / reduce_scatter_tensor: counted or not, see the next check
    for key in ("broadcast", "allgather", "reduce_scatter", "alltoall_base", "alltoall",
                "barrier"):
        if d1.get(key, 0) <= d0.get(key, 0):
            problems.append(f"{key} not counted as delegated: {d0} -> {d1}")
    if g.rank in (0, 1):
        for key in ("send", "recv"):
            if d1.get(key, 0) != d0.get(key, 0) + 1:
                problems.append(f"{key} not counted once: {d0} -> {d1}")
    _expect(not problems, "; ".join(problems))


def _broadcast_and_gathers(g: Group, problems: list[str]) -> None:
    rank, world = g.rank, g.world
    b = torch.arange(10, dtype=torch.float32) if rank == 1 else torch.zeros(10)
    dist.broadcast(b, src=1)
    if not torch.equal(b, torch.arange(10, dtype=torch.float32)):
        problems.append(f"broadcast: {b}")
    outs = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), rank, dtype=torch.int64))
    if [o.tolist() for o in outs] != [[r] * 3 for r in range(world)]:
        problems.append(f"all_gather: {outs}")
    big = torch.zeros(world * 4)
    dist.all_gather_into_tensor(big, torch.full((4,), float(rank)))
    if not torch.equal(big, torch.arange(world).repeat_interleave(4).float()):
        problems.append(f"all_gather_into_tensor: {big}")


def _reduce_scatters(g: Group, problems: list[str]) -> None:
    rank, world = g.rank, g.world
    out = torch.zeros(2)
    dist.reduce_scatter(out, [torch.full((2,), float(rank * 10 + j)) for j in range(world)])
    exp = torch.full((2,), float(sum(r * 10 + rank for r in range(world))))
    if not torch.equal(out, exp):
        problems.append(f"reduce_scatter: {out} vs {exp}")
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(world * 2, dtype=torch.float32) + rank)
    exp = (torch.arange(2, dtype=torch.float32) + 2 * rank) * world + sum(range(world))
    if not torch.equal(out, exp):
        problems.append(f"reduce_scatter_tensor: {out} vs {exp}")


def _barrier_and_point_to_point(g: Group, problems: list[str]) -> None:
    dist.barrier()
    if g.rank == 0:
        dist.send(torch.arange(5, dtype=torch.float64) * 3, dst=1)
        r = torch.zeros(5, dtype=torch.int32)
        dist.recv(r, src=1)
        if not torch.equal(r, torch.arange(5, dtype=torch.int32) - 4):
            problems.append(f"recv from 1: {r}")
    elif g.rank == 1:
        r = torch.zeros(5, dtype=torch.float64)
        dist.recv(r, src=0)
        if not torch.equal(r, torch.arange(5, dtype=torch.float64) * 3):
            problems.append(f"recv from 0: {r}")
        dist.send(torch.arange(5, dtype=torch.int32) - 4, dst=0)


def _all_to_all_and_objects(g: Group, problems: list[str]) -> None:
    rank, world = g.rank, g.world
    out = torch.zeros(world)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + 10 * rank)
    if not torch.equal(out, torch.arange(world, dtype=torch.float32) * 10 + rank):
        problems.append(f"all_to_all_single: {out}")
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), 10 * rank + j, dtype=torch.int64)
                           for j in range(world)])
    if [o.tolist() for o in outs] != [[10 * r + rank] * 2 for r in range(world)]:
        problems.append(f"all_to_all: {outs}")
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    if objs != [{"rank": r, "s": "x" * r} for r in range(world)]:
        problems.append(f"all_gather_object: {objs}")


@check("tensor_collectives_counted")
def tensor_collectives_counted(g: Group) -> None:
    """The module promises every collective that is not the switch's is counted."""
    world = g.world
    problems = []
    for name, key, call in (
            ("all_gather_into_tensor", "allgather_into_tensor",
             lambda: dist.all_gather_into_tensor(torch.zeros(world * 2), torch.ones(2))),
            ("reduce_scatter_tensor", "reduce_scatter_tensor",
             lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(world * 2)))):
        d0 = _delegated()
        call()
        d1 = _delegated()
        if sum(d1.values()) != sum(d0.values()) + 1:
            problems.append(f"dist.{name} not counted in stats()['delegated'] "
                            f"(expected key {key!r}): {d0} -> {d1}")
    _expect(not problems, "; ".join(problems))


@check("stats_api")
def stats_api(g: Group) -> None:
    s = stt.stats()
    _expect(set(s) >= {"switch_ops", "delegated", "worker", "switch"}, f"stats: {s}")
    host, port = s["switch"].rsplit(":", 1)
    _expect(host == "127.0.0.1" and int(port) > 0, f"switch address {s['switch']}")
    try:
        stt.stats(g.gloo)
    except TypeError:
        pass
    else:
        raise AssertionError("stats(gloo group) did not raise TypeError")


# -- switchml subgroups ---------------------------------------------------------------------------

@check("new_group_subset")
def subgroups(g: Group) -> None:
    rank = g.rank
    problems = []
    sub01 = dist.new_group([0, 1], backend="switchml")
    sub12 = dist.new_group([1, 2], backend="switchml")
    x = torch.full((40_001,), float(rank + 1))
    y = torch.arange(6, dtype=torch.int64) * (rank + 1)
    if rank in (0, 1):
        dist.all_reduce(x, group=sub01)
        dist.all_reduce(y, group=sub01, op=R.AVG)
        if not torch.equal(x, torch.full((40_001,), 3.0)):
            problems.append(f"[0, 1] float sum: {x[:3]}")
        if not torch.equal(y, torch.arange(6, dtype=torch.int64) * 3 // 2):
            problems.append(f"[0, 1] int64 avg: {y}")
        if stt.stats(sub01)["switch_ops"].get("allreduce") != 2:
            problems.append(f"[0, 1] stats: {stt.stats(sub01)}")
    else:
        if sub01 != dist.GroupMember.NON_GROUP_MEMBER:
            problems.append(f"rank 2 has a [0, 1] group: {sub01}")
        if not torch.equal(x, torch.full((40_001,), float(rank + 1))):  # untouched
            problems.append("rank 2's tensor changed")
    z = torch.full((17,), float(rank))
    if rank in (1, 2):
        dist.all_reduce(z, group=sub12)
        if not torch.equal(z, torch.full((17,), 3.0)):
            problems.append(f"[1, 2] sum: {z}")
    # the default group still works after its subgroups' jobs ran on the same switch
    w = torch.full((1000,), float(rank))
    dist.all_reduce(w)
    if not torch.equal(w, torch.full((1000,), 3.0)):
        problems.append(f"default group after subgroups: {w[:3]}")
    _expect(not problems, "; ".join(problems))


# -- current PyTorch: functional collectives, DeviceMesh, torch.compile ---------------------------

@check("functional_collectives")
def functional_collectives(g: Group) -> None:
    """``torch.distributed._functional_collectives.all_reduce`` (what compiled code and DTensor
    call) on the switchml group, against gloo."""
    import torch.distributed._functional_collectives as fc
    x = torch.arange(4001, dtype=torch.float32) * (g.rank + 1) - 7.0
    got = fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))
    ref = x.clone()
    dist.all_reduce(ref, group=g.gloo)
    _expect(torch.equal(got, ref), f"functional all_reduce: {got[:3]} against gloo {ref[:3]}")
    _expect(torch.equal(x, torch.arange(4001, dtype=torch.float32) * (g.rank + 1) - 7.0),
            "functional all_reduce changed its input")


@check("device_mesh")
def device_mesh(g: Group) -> None:
    """A 1-D DeviceMesh over the switchml group: its group's all_reduce goes through the
    switch."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (g.world,))
    before = stt.stats(mesh.get_group())["switch_ops"].get("allreduce", 0)
    t = torch.full((3001,), float(g.rank) + 0.5)
    dist.all_reduce(t, group=mesh.get_group())
    want = sum(r + 0.5 for r in range(g.world))
    _expect(torch.equal(t, torch.full((3001,), want)), f"mesh all_reduce: {t[:3]}")
    after = stt.stats(mesh.get_group())["switch_ops"].get("allreduce", 0)
    _expect(after == before + 1, f"the mesh's all_reduce did not go through the switch "
            f"({before} -> {after})")


@check("ddp_over_torch_compile")
def ddp_compiled(g: Group) -> None:
    """DDP over a ``torch.compile``d model (inductor), trained 3 steps on the switchml group
    and, from the same start, on gloo: the same parameters within the quantization bound."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    models = []
    for group in (None, g.gloo):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, 4))
        ddp = DDP(torch.compile(net), process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(g.rank)
        for _ in range(3):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        models.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    ours, ref = models
    err = float((ours - ref).abs().max())
    _expect(err <= 1e-5 * float(ref.abs().max()), f"compiled DDP differs from gloo by {err}")


# -- overlap --------------------------------------------------------------------------------------

@check("overlap_async_returns_before_completion")
def overlap_async(g: Group) -> None:
    x = torch.full((8 * 2**20,), float(g.rank + 1))
    work = dist.all_reduce(x, async_op=True)
    done_at_return = work.is_completed()
    a = torch.randn(64, 64)
    units = 0
    while not work.is_completed() and units < 100_000:
        a = torch.tanh(a @ a)  # the caller's own work, meanwhile
        units += 1
    work.wait()
    _expect(not done_at_return, "all_reduce of 8M floats was complete when it returned")
    _expect(units > 0, "no work could be done before the all_reduce completed")
    _expect(bool(torch.all(x == 6.0)), "8M-element result wrong")


@check("overlap_ddp_buckets_during_backward")
def overlap_ddp(g: Group) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    ddp = DDP(model, bucket_cap_mb=1)
    events, backward_done = _backward_with_recorded_allreduces(g, model, ddp)
    calls = [e for e in events if e[0] == "allreduce"]
    grad0 = [e[1] for e in events if e[0] == "first_layer_grad"]
    _expect(len(calls) >= 3, f"expected several buckets, got {len(calls)} allreduce calls")
    _expect(len(grad0) == 1, f"first-layer grad hook ran {len(grad0)} times")
    _expect(calls[0][1] < grad0[0] < backward_done,
            f"first allreduce issued at {calls[0][1] - backward_done:+.4f} s, first layer's "
            f"gradient at {grad0[0] - backward_done:+.4f} s (relative to backward's end): "
            "no bucket went out while backward was still computing")
    _expect(any(not c[2] for c in calls),
            "every allreduce was already complete when it returned (not asynchronous)")
    digests_p: list[Any] = [None] * g.world
    h = hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
    dist.all_gather_object(digests_p, h.hexdigest(), group=g.gloo)
    _expect(len(set(digests_p)) == 1, "DDP gradients differ between ranks")


def _backward_with_recorded_allreduces(g: Group, model: Any,
                                       ddp: Any) -> tuple[list[tuple[str, float, bool]], float]:
    """Two DDP backward passes (the 2nd with DDP's rebuilt buckets); the events of the last:
    each allreduce issued (time, complete when it returned?) and the first layer's gradient."""
    pg = dist.distributed_c10d._get_default_group()
    events: list[tuple[str, float, bool]] = []
    orig = pg.allreduce

    def recording_allreduce(*args: Any, **kwargs: Any) -> Any:
        t = time.monotonic()
        work = orig(*args, **kwargs)
        events.append(("allreduce", t, work.is_completed()))
        return work

    def first_layer_grad(grad: Any) -> None:
        events.append(("first_layer_grad", time.monotonic(), False))

    model[0].weight.register_hook(first_layer_grad)
    pg.allreduce = recording_allreduce  # instance attribute: what DDP's reducer calls
    try:
        data = torch.randn(64, 512, generator=torch.Generator().manual_seed(g.rank))
        for _ in range(2):  # the 2nd iteration runs with DDP's rebuilt buckets
            events.clear()
            ddp(data).square().mean().backward()
            backward_done = time.monotonic()
    finally:
        del pg.allreduce
    return events, backward_done


# -- the body ------------------------------------------------------------------------------------

def _run_check(fn: Check, g: Group) -> str | None:
    """None if the check passed, else its exception's type and message."""
    try:
        fn(g)
    except Exception as exc:  # noqa: BLE001 - recorded per check
        return f"{type(exc).__name__}: {exc}"[:3000]
    return None


def backend_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """Every check of ``CHECKS`` in order, in one 3-rank group; the outcome of each (None:
    passed), the backend's final stats and the float cases' error margins."""
    _init("switchml", timeout_s=20)
    g = Group(rank, world, dist.new_group(backend="gloo"))
    checks = {name: _run_check(fn, g) for name, fn in CHECKS.items()}
    final = stt.stats()
    dist.destroy_process_group()
    return {"checks": checks, "stats": final, "margins": g.margins}
