"""Spawn harness and process bodies for the PyTorch backend tests.

Spawned children import this module by name (pytest puts ``tests/torch`` on ``sys.path`` and the
spawn start method hands ``sys.path`` to the child), so every process body lives here.

Parent side: :class:`Procs` starts processes (``spawn``), tags every one of them with an
environment variable that their own children (the embedded switch) inherit, gives every wait a
hard deadline, and on exit kills whatever is left and reports leftover tagged processes, so a
test can assert that no switch outlived its group.

Child side: :func:`rank_main` sets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and
runs a body ``body(rank, world, q, *args)``; the body's return value (picklable, no tensors:
tensors cross the queue as numpy arrays) goes to the parent as ``("result", rank, value)``, an
exception as ``("error", rank, traceback)``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import math
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from switchml.transport.udp import elements_per_packet_for

TAG_ENV = "SWITCHML_TORCH_TEST_TAG"
CTX = mp.get_context("spawn")


# -- parent side ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds ``TAG_ENV=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if needle not in env:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":  # a zombie is dead; only its parent has not reaped it yet
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours
            continue
        found.append((int(entry), cmd))
    return found


def is_switch_cmd(cmd: str) -> bool:
    return "switchml" in cmd and " switch " in f" {cmd} " and "--port" in cmd


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


class Procs:
    """Processes of one test, all with a hard deadline; use as a context manager.

    ``leftover`` (after exit): tagged processes that were still alive after the grace period
    (they have been killed). ``leftover_switches`` is the part of it that were switches.
    """

    def __init__(self, deadline_s: float) -> None:
        self.deadline = time.monotonic() + deadline_s
        self.tag = uuid.uuid4().hex
        self.q = CTX.Queue()
        self.procs: list[Any] = []
        self.leftover: list[tuple[int, str]] = []
        self.leftover_switches: list[tuple[int, str]] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, target: Callable[..., Any], *args: Any) -> Any:
        p = CTX.Process(target=_tagged_entry, args=(self.tag, target, args), daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def start_ranks(self, body: Callable[..., Any], world: int, *args: Any,
                    port: int | None = None, env: dict[str, str] | None = None) -> list[Any]:
        port = port or free_port()
        return [self.start(rank_main, body, r, world, port, self.q, dict(env or {}), args)
                for r in range(world)]

    def get(self, timeout: float | None = None) -> tuple:
        """Next message, within ``timeout`` and the test's deadline (else AssertionError).

        Fails at once (after a last look at the queue) when every process has exited.
        """
        wait = self.left() if timeout is None else min(timeout, self.left())
        end = time.monotonic() + wait
        while True:
            all_dead = not any(p.is_alive() for p in self.procs)
            try:
                return self.q.get(timeout=1.0 if all_dead else
                                  max(min(0.5, end - time.monotonic()), 0.01))
            except queue.Empty:
                pass
            if all_dead:
                codes = [p.exitcode for p in self.procs]
                raise AssertionError(f"every process exited without a message (exit codes "
                                     f"{codes}; negative = killed by that signal)")
            if time.monotonic() >= end:
                alive = [p.pid for p in self.procs if p.is_alive()]
                raise AssertionError(f"no message within {wait:.1f} s (alive: {alive})")

    def results(self, ranks: int | list[int], timeout: float | None = None) -> dict[int, Any]:
        """Collect the final message of each rank; errors raise AssertionError with tracebacks.

        Other messages (progress reports) that arrive meanwhile are skipped.
        """
        want = set(range(ranks)) if isinstance(ranks, int) else set(ranks)
        out: dict[int, Any] = {}
        errors = []
        end = time.monotonic() + (self.left() if timeout is None else timeout)
        while want - set(out) - {e[0] for e in errors}:
            msg = self.get(timeout=end - time.monotonic())
            if msg[0] == "result":
                out[msg[1]] = msg[2]
            elif msg[0] == "error":
                errors.append((msg[1], msg[2]))
        if errors:
            raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors))
        return out

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(timeout=max(end - time.monotonic(), 0.01))

    def close(self, grace_s: float = 5.0) -> None:
        self.join(min(max(self.left(), 1.0), 15.0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        # Whatever the tagged processes started (the embedded switch) must go away on its own.
        end = time.monotonic() + grace_s
        left = tagged_processes(self.tag)
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = tagged_processes(self.tag)
        self.leftover = left
        self.leftover_switches = [x for x in left if is_switch_cmd(x[1])]
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.q.close()
        self.q.cancel_join_thread()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- child side ----------------------------------------------------------------------------------

def _tagged_entry(tag: str, target: Callable[..., Any], args: tuple) -> None:
    os.environ[TAG_ENV] = tag
    target(*args)


def rank_main(body: Callable[..., Any], rank: int, world: int, port: int, q: Any,
              env: dict[str, str], args: tuple) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world), **env})
    try:
        value = body(rank, world, q, *args)
        q.put(("result", rank, value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, traceback.format_exc()))
    q.close()
    q.join_thread()


def _init(backend: str = "switchml", timeout_s: float = 10.0, **kw: Any) -> None:
    import torch.distributed as dist

    import switchml.torch  # noqa: F401 - registers the backend

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def exit_now(q: Any, msg: tuple | None = None, code: int = 0) -> None:
    """Flush ``msg`` to the parent and leave without any cleanup (no atexit, no destructors)."""
    if msg is not None:
        q.put(msg)
    q.close()
    q.join_thread()
    os._exit(code)


# -- numbers: inputs, references, the documented error bound -------------------------------------

# Elements per packet: the backend's default (SWITCHML_ELEMENTS_PER_PACKET unset): as many as
# fit the path MTU towards the embedded switch on loopback.
K = elements_per_packet_for(("127.0.0.1", 48864))
DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64"]
OPS = ["SUM", "AVG"]
SHAPES = ["scalar", "one", "odd1d", "twod", "transposed", "strided"]
ALLREDUCE_CASES = [f"{d}-{o}-{s}" for d, o, s in itertools.product(DTYPES, OPS, SHAPES)]


def scale_bits(n: int) -> int:
    return 31 - n.bit_length()


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def make_input(dtype: str, shape: str, rank: int) -> tuple[Any, Any]:
    """``(tensor, base)``: the rank's deterministic input, possibly a non-contiguous view of base.

    Floats mix magnitudes (so blocks have different exponents); the odd 1-D case has an all-zero
    block on every rank. int64 includes values at and near +-2**62 and the int64 limits, so the
    sum wraps modulo 2**64.
    """
    import torch

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
    import torch

    flat = t.reshape(-1)
    if t.is_floating_point():
        return flat.to(torch.float64).numpy().copy()
    return flat.to(torch.int64).numpy().copy()


def half_ulp(dtype: str, v: Any) -> Any:
    """Half a unit in the last place of ``dtype`` at magnitude ``|v|`` (numpy, elementwise)."""
    import numpy as np
    import torch

    fi = torch.finfo(_torch_dtype(dtype))
    _, e = np.frexp(np.abs(np.asarray(v, dtype=np.float64)))
    step = np.maximum(np.ldexp(1.0, e - 1), fi.tiny) * fi.eps
    return 0.5 * step


def switch_tolerance(dtype: str, xs: list[Any], average: bool) -> Any:
    """The documented error bound per element (docs/protocol.md section 4), plus rounding.

    Sum: ``n * 0.5 * 2**(emax - P)`` with ``emax`` the block exponent (max over ranks of the
    ``frexp`` exponent of the block's max magnitude, blocks of K elements in logical order),
    plus the rounding of the result to the dtype (bfloat16 travels as float32 and is rounded
    twice: to float32, then to bfloat16). AVG divides the rounded sum and rounds once more.
    """
    import numpy as np

    n = len(xs)
    numel = xs[0].size
    bound = np.zeros(numel)
    for b0 in range(0, max(numel, 1), K):
        m = max(float(np.max(np.abs(x[b0:b0 + K]))) if numel else 0.0 for x in xs)
        if m == 0.0:
            continue
        emax = math.frexp(m)[1]
        bound[b0:b0 + K] = n * 0.5 * math.ldexp(1.0, emax - scale_bits(n))
    total = np.abs(np.sum(xs, axis=0)) + bound  # |sum| can be at most this before rounding
    rnd = half_ulp(dtype, total)
    if dtype == "bfloat16":
        rnd = rnd + half_ulp("float32", total)
    if not average:
        return bound + rnd
    return (bound + rnd) / n + half_ulp(dtype, total / n + rnd / n)


def gloo_tolerance(dtype: str, xs: list[Any], average: bool) -> Any:
    """How far gloo's sum, in the dtype, may be from the exact one: n - 1 roundings."""
    import numpy as np

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
    import numpy as np

    total = [sum(int(x[i]) for x in xs) for i in range(xs[0].size)]
    wrapped = [(v + 2**63) % 2**64 - 2**63 for v in total]
    if average:
        wrapped = [abs(v) // n * (1 if v >= 0 else -1) for v in wrapped]
    return np.array(wrapped, dtype=np.int64).reshape(xs[0].shape)


def int_wrap(dtype: str, arr: Any) -> Any:
    import numpy as np

    return arr.astype(np.int32) if dtype == "int32" else arr


# -- body: the backend compared with gloo, many checks in one group ------------------------------

class Checks:
    """Runs named checks in one group; a failing check records its message and the run goes on.

    Every check issues the same collectives on every rank before comparing anything, so one
    wrong result does not desynchronise the ranks.
    """

    def __init__(self) -> None:
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.results[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded per check
            self.results[name] = f"{type(exc).__name__}: {exc}"[:3000]


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def backend_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """All the backend checks of test_torch_backend.py, in one 3-rank group."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import switchml.torch as stt

    _init("switchml", timeout_s=20)
    gloo = dist.new_group(backend="gloo")
    checks = Checks()
    R = dist.ReduceOp
    digests: dict[str, str] = {}
    margins: dict[str, float] = {}  # max error / bound per float case (for the curious)

    def delegated() -> dict[str, int]:
        return dict(stt.stats()["delegated"])

    def switch_ops() -> int:
        return int(stt.stats()["switch_ops"].get("allreduce", 0))

    # -- all_reduce: dtype x op x shape against gloo and the exact sum with the bound -------------
    def allreduce_case(case: str) -> Callable[[], None]:
        dtype, opname, shape = case.split("-")

        def check() -> None:
            average = opname == "AVG"
            x, base = make_input(dtype, shape, rank)
            base_before = base.clone()
            xs = [flat64(make_input(dtype, shape, r)[0]) for r in range(world)]
            mine = x.clone().contiguous()
            ptr, storage = x.data_ptr(), base.untyped_storage().data_ptr()
            before = switch_ops()
            ret = dist.all_reduce(x, op=getattr(R, opname))
            after = switch_ops()
            g = mine.clone()
            dist.all_reduce(g, op=R.SUM, group=gloo)
            got = flat64(x)
            digests[case] = hashlib.sha256(got.tobytes()).hexdigest()
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
            gsum = flat64(g)
            if dtype.startswith("int"):
                ref = int_wrap(dtype, int_reference(xs, average, world))
                exp_gloo = gsum if not average else int_reference([gsum], True, world)
                bad = np.flatnonzero(got != ref)
                _expect(bad.size == 0, f"{bad.size} wrong elements, first at {bad[:3]}: got "
                        f"{got[bad[:3]]}, exact {ref[bad[:3]]}")
                bad = np.flatnonzero(got != exp_gloo)
                _expect(bad.size == 0, f"{bad.size} elements differ from gloo, first at "
                        f"{bad[:3]}: got {got[bad[:3]]}, gloo {exp_gloo[bad[:3]]}")
                return
            exact = np.sum(xs, axis=0)
            if average:
                exact = exact / world
            tol = switch_tolerance(dtype, xs, average)
            tol = tol + np.abs(exact) * 2.0**-50  # the float64 reference's own rounding
            err = np.abs(got - exact)
            margins[case] = float(np.max(err / tol, initial=0.0))
            bad = np.flatnonzero(~(err <= tol))
            _expect(bad.size == 0, f"{bad.size} elements beyond the documented bound, first at "
                    f"{bad[:3]}: got {got[bad[:3]]}, exact {exact[bad[:3]]}, err {err[bad[:3]]}, "
                    f"bound {tol[bad[:3]]}")
            if average:
                gref = flat64(g.div(world))
            else:
                gref = gsum
            gtol = tol + gloo_tolerance(dtype, xs, average)
            gerr = np.abs(got - gref)
            bad = np.flatnonzero(~(gerr <= gtol))
            _expect(bad.size == 0, f"{bad.size} elements differ from gloo beyond the bound, "
                    f"first at {bad[:3]}: got {got[bad[:3]]}, gloo {gref[bad[:3]]}")

        return check

    for case in ALLREDUCE_CASES:
        checks.run(f"allreduce[{case}]", allreduce_case(case))

    def same_on_all_ranks() -> None:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, digests, group=gloo)
        for case in ALLREDUCE_CASES:
            vals = {d.get(case) for d in everyone}
            _expect(len(vals) == 1, f"{case}: ranks got different results")

    checks.run("allreduce_bitwise_same_on_all_ranks", same_on_all_ranks)

    def complex_sum() -> None:
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(50, generator=g, dtype=torch.complex64) for _ in range(world)]
        x = xs[rank].clone()
        dist.all_reduce(x)
        exact = sum(t.to(torch.complex128) for t in xs)
        _expect(torch.allclose(x.to(torch.complex128), exact, rtol=0, atol=1e-5),
                f"complex64 sum wrong: {x[:3]} vs {exact[:3]}")

    checks.run("complex64_sum", complex_sum)

    # -- async_op and the Work/Future API -------------------------------------------------------
    def async_work() -> None:
        x = torch.full((100_003,), float(rank + 1))
        before = switch_ops()
        work = dist.all_reduce(x, async_op=True)
        ok = work.wait()
        fut_value = work.get_future().wait()
        _expect(switch_ops() == before + 1, "async all_reduce did not go through the switch")
        _expect(ok is True, f"wait() returned {ok!r}")
        _expect(work.is_completed() and work.is_success(), "completed work not completed")
        _expect(isinstance(fut_value, list) and len(fut_value) == 1 and fut_value[0] is x,
                f"future value is not [x]: {type(fut_value)}")
        _expect(torch.equal(x, torch.full((100_003,), 6.0)), f"async result wrong: {x[:3]}")
        # int64 too, with AVG: the future fires after the limbs were put back and divided.
        y = torch.full((5,), 10 * (rank + 1), dtype=torch.int64)
        fut_value = dist.all_reduce(y, op=R.AVG, async_op=True).get_future().wait()
        _expect(fut_value[0] is y and torch.equal(y, torch.full((5,), 20, dtype=torch.int64)),
                f"async int64 AVG wrong: {y}")

    checks.run("async_op_work_and_future", async_work)

    def coalesced() -> None:
        a = torch.arange(40_001, dtype=torch.float32) * (rank + 1)
        b = torch.full((3, 5), 2.0 * (rank + 1))
        c = torch.arange(24, dtype=torch.float32).reshape(4, 6).t() * (rank + 1)  # non-contig.
        ta, tb, tc = a.clone(), b.clone(), c.clone()
        before = switch_ops()
        ret = dist.all_reduce_coalesced([ta, tb, tc])
        _expect(ret is None, f"sync all_reduce_coalesced returned {ret!r}")
        _expect(switch_ops() > before, "coalesced all-reduce did not go through the switch")
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

    checks.run("all_reduce_coalesced", coalesced)

    # -- ops and dtypes the switch does not do: delegated to gloo, counted ----------------------
    def delegated_ops() -> None:
        problems = []
        for opname, fn in (("MIN", min), ("MAX", max), ("PRODUCT", math.prod)):
            for dtype in ("float32", "int64"):
                vals = [[(r + 1) * (-1) ** (i + r) * (i + 1) for i in range(7)]
                        for r in range(world)]
                x = torch.tensor(vals[rank], dtype=_torch_dtype(dtype))
                d0, s0 = delegated(), switch_ops()
                dist.all_reduce(x, op=getattr(R, opname))
                d1, s1 = delegated(), switch_ops()
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
        x = torch.full((9,), rank + 1, dtype=torch.uint8)
        d0 = delegated()
        dist.all_reduce(x)
        d1 = delegated()
        if not torch.equal(x, torch.full((9,), 6, dtype=torch.uint8)):
            problems.append(f"uint8 SUM: {x.tolist()}")
        if d1.get("allreduce:SUM", 0) != d0.get("allreduce:SUM", 0) + 1:
            problems.append(f"uint8 SUM not counted as delegated: {d0} -> {d1}")
        _expect(not problems, "; ".join(problems))

    checks.run("min_max_product_delegated_and_counted", delegated_ops)

    # -- the other collectives (gloo underneath), counted ----------------------------------------
    def collectives() -> None:
        problems = []
        d0 = delegated()
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
        dist.barrier()
        if rank == 0:
            dist.send(torch.arange(5, dtype=torch.float64) * 3, dst=1)
            r = torch.zeros(5, dtype=torch.int32)
            dist.recv(r, src=1)
            if not torch.equal(r, torch.arange(5, dtype=torch.int32) - 4):
                problems.append(f"recv from 1: {r}")
        elif rank == 1:
            r = torch.zeros(5, dtype=torch.float64)
            dist.recv(r, src=0)
            if not torch.equal(r, torch.arange(5, dtype=torch.float64) * 3):
                problems.append(f"recv from 0: {r}")
            dist.send(torch.arange(5, dtype=torch.int32) - 4, dst=0)
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
        d1 = delegated()
        # all_gather_into_tensor / reduce_scatter_tensor: counted or not, see the next check
        for key in ("broadcast", "allgather", "reduce_scatter", "alltoall_base", "alltoall",
                    "barrier"):
            if d1.get(key, 0) <= d0.get(key, 0):
                problems.append(f"{key} not counted as delegated: {d0} -> {d1}")
        if rank in (0, 1):
            for key in ("send", "recv"):
                if d1.get(key, 0) != d0.get(key, 0) + 1:
                    problems.append(f"{key} not counted once: {d0} -> {d1}")
        _expect(not problems, "; ".join(problems))

    checks.run("other_collectives_delegated", collectives)

    def tensor_collectives_counted() -> None:
        """The module promises every collective that is not the switch's is counted."""
        problems = []
        for name, key, call in (
                ("all_gather_into_tensor", "allgather_into_tensor",
                 lambda: dist.all_gather_into_tensor(torch.zeros(world * 2), torch.ones(2))),
                ("reduce_scatter_tensor", "reduce_scatter_tensor",
                 lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(world * 2)))):
            d0 = delegated()
            call()
            d1 = delegated()
            if sum(d1.values()) != sum(d0.values()) + 1:
                problems.append(f"dist.{name} not counted in stats()['delegated'] "
                                f"(expected key {key!r}): {d0} -> {d1}")
        _expect(not problems, "; ".join(problems))

    checks.run("tensor_collectives_counted", tensor_collectives_counted)

    def stats_api() -> None:
        s = stt.stats()
        _expect(set(s) >= {"switch_ops", "delegated", "worker", "switch"}, f"stats: {s}")
        host, port = s["switch"].rsplit(":", 1)
        _expect(host == "127.0.0.1" and int(port) > 0, f"switch address {s['switch']}")
        try:
            stt.stats(gloo)
        except TypeError:
            pass
        else:
            raise AssertionError("stats(gloo group) did not raise TypeError")

    checks.run("stats_api", stats_api)

    # -- switchml subgroups ----------------------------------------------------------------------
    def subgroups() -> None:
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

    checks.run("new_group_subset", subgroups)

    # -- overlap -----------------------------------------------------------------------------------
    def overlap_async() -> None:
        x = torch.full((8 * 2**20,), float(rank + 1))
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

    checks.run("overlap_async_returns_before_completion", overlap_async)

    def overlap_ddp() -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers)
        ddp = DDP(model, bucket_cap_mb=1)
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
            data = torch.randn(64, 512, generator=torch.Generator().manual_seed(rank))
            for _ in range(2):  # the 2nd iteration runs with DDP's rebuilt buckets
                events.clear()
                ddp(data).square().mean().backward()
                backward_done = time.monotonic()
        finally:
            del pg.allreduce
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
        digests_p: list[Any] = [None] * world
        h = hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
        dist.all_gather_object(digests_p, h.hexdigest(), group=gloo)
        _expect(len(set(digests_p)) == 1, "DDP gradients differ between ranks")

    checks.run("overlap_ddp_buckets_during_backward", overlap_ddp)

    final = stt.stats()
    dist.destroy_process_group()
    return {"checks": checks.results, "stats": final, "margins": margins}


# -- body: DDP training on gloo, switchml, switchml ----------------------------------------------

def _ddp_train(rank: int, steps: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 3))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        xb = torch.randn(32, 20, generator=g)
        yb = torch.randn(32, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xb), yb).backward()
        opt.step()
    return {"final": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            "init": {k: v.numpy().copy() for k, v in init.items()}}


def ddp_body(rank: int, world: int, q: Any, backend: str, steps: int) -> dict[str, Any]:
    """Train with DDP on ``backend`` for ``steps`` steps; return the model before and after."""
    import torch.distributed as dist

    import switchml.torch as stt

    _init(backend, timeout_s=20)
    run = _ddp_train(rank, steps)
    if backend == "switchml":
        run["stats"] = stt.stats()
    dist.destroy_process_group()
    return run


def reinit_body(rank: int, world: int, q: Any, delay_s: float, timeout_s: float,
                port2: int) -> dict[str, Any]:
    """Two default-group lifetimes in the same processes, ``delay_s`` apart.

    The second one all-reduces for about 3 s (longer than the backend's 2 s switch grace
    period).
    """
    import torch
    import torch.distributed as dist

    _init("switchml", timeout_s=timeout_s)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    first_ok = bool(torch.all(x == sum(range(1, world + 1))))
    dist.destroy_process_group()
    time.sleep(delay_s)
    os.environ["MASTER_PORT"] = str(port2)  # a fresh store
    outcome: dict[str, Any] = {"first_ok": first_ok, "ops": 0, "error": None}
    try:
        _init("switchml", timeout_s=timeout_s)
        # A fixed number of operations (every rank must issue the same ones), about 3 s.
        for _ in range(100):
            x = torch.full((1000,), float(rank + 1))
            dist.all_reduce(x)
            if not bool(torch.all(x == sum(range(1, world + 1)))):
                raise AssertionError(f"wrong sum {x[:3]}")
            outcome["ops"] += 1
            time.sleep(0.03)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        exit_now(q, ("result", rank, outcome))  # a broken group: don't wait for its teardown
    return outcome


# -- bodies: failures ----------------------------------------------------------------------------

def dying_rank_body(rank: int, world: int, q: Any, mode: str, die_rank: int, die_step: int,
                    timeout_s: float) -> dict[str, Any]:
    """Training; ``die_rank`` exits abruptly (``os._exit``) before step ``die_step``'s backward.

    ``mode`` "manual": the gradients are averaged with ``dist.all_reduce`` (AVG) after
    backward; "ddp": DistributedDataParallel all-reduces them during backward. The survivors
    report the error of the step that needed the dead rank and how long it took to come.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init("switchml", timeout_s=timeout_s)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8))
    net = DDP(model) if mode == "ddp" else model
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(die_step + 1):
        loss = net(torch.randn(16, 32, generator=g)).square().mean()
        if rank == die_rank and step == die_step:
            exit_now(q, ("died", rank, step))  # mid-training, no cleanup at all
        opt.zero_grad()
        t0 = time.monotonic()
        try:
            loss.backward()  # DDP: the gradient all-reduce of this step needs the dead rank
            if mode == "manual":
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            opt.step()
        except RuntimeError as exc:
            outcome = {"step": step, "error": str(exc), "seconds": time.monotonic() - t0}
            if rank == 0:  # then a crash of the switch's owner: the switch must go with it
                exit_now(q, ("result", rank, outcome), code=3)
            return outcome
    return {"step": None, "error": None, "seconds": None}


def switch_server_body(q: Any) -> None:
    """A SwitchServer in a process of its own (SIGKILLed by the test)."""
    from switchml.transport.udp import SwitchServer

    server = SwitchServer(host="127.0.0.1", port=0).start()
    q.put(("switch", server.address, os.getpid()))
    time.sleep(120)


def switch_loss_body(rank: int, world: int, q: Any, timeout_s: float) -> dict[str, Any]:
    """All-reduce in a loop through an external switch until it fails (the test kills it)."""
    import torch
    import torch.distributed as dist

    import switchml.torch as stt

    _init("switchml", timeout_s=timeout_s)
    switch = stt.stats()["switch"]
    x = torch.ones(50_000)
    end = time.monotonic() + 60
    i = 0
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            exit_now(q, ("result", rank, {"ok_ops": i, "error": str(exc), "when": time.time(),
                                          "seconds": time.monotonic() - t0,
                                          "switch": switch}))
        x.fill_(1.0)
        i += 1
        if i == 5:
            q.put(("progress", rank, i))
        time.sleep(0.01)
    return {"ok_ops": i, "error": None, "when": time.time(), "switch": switch}


def subgroup_owner_body(rank: int, world: int, q: Any, timeout_s: float) -> dict[str, Any]:
    """Default group gloo; two switchml subgroups; the one that started the switch is
    destroyed; the other one all-reduces 3 s later."""
    import torch
    import torch.distributed as dist

    _init("gloo", timeout_s=timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    a = dist.new_group(backend="switchml", timeout=timeout)  # its rank 0 starts the switch
    b = dist.new_group(backend="switchml", timeout=timeout)  # reuses it
    x = torch.ones(100)
    dist.all_reduce(x, group=b)
    before_ok = bool(torch.all(x == world))
    dist.destroy_process_group(a)
    time.sleep(3.0)
    x = torch.ones(100)
    try:
        dist.all_reduce(x, group=b)
        error = None if bool(torch.all(x == world)) else f"wrong sum {x[:3]}"
    except RuntimeError as exc:
        error = str(exc)
    exit_now(q, ("result", rank, {"before_ok": before_ok, "error": error}))
    return {}


# -- body: embedded switch life cycle ------------------------------------------------------------

def lifecycle_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """One group; rank 0 reports its embedded switch's pid and whether destroy stopped it."""
    import torch
    import torch.distributed as dist

    from switchml.torch import backend

    _init("switchml", timeout_s=10)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    ok = bool(torch.all(x == 3.0))
    pid = backend.embedded_switch_pid()
    dist.destroy_process_group()
    alive_after_destroy = None
    if pid is not None:
        end = time.monotonic() + 8  # the backend stops it after a grace period (2 s)
        while pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        alive_after_destroy = pid_alive(pid)
    return {"ok": ok, "switch_pid": pid, "alive_after_destroy": alive_after_destroy}


def mismatch_body(rank: int, world: int, q: Any, timeout_s: float) -> dict[str, Any]:
    """Rank 1 all-reduces a tensor of another size (a bug in the user's script)."""
    import torch
    import torch.distributed as dist

    _init("switchml", timeout_s=timeout_s)
    dist.all_reduce(torch.ones(100))  # a good operation first
    x = torch.ones(30_000 + (7 if rank == 1 else 0))
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def nested_wait_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """A then-callback that waits for another switchml collective (as PowerSGD-style hooks do):
    it must not deadlock the worker's single I/O thread."""
    import torch
    import torch.distributed as dist

    _init("switchml", timeout_s=5.0)
    x, y = torch.ones(8), torch.ones(8)
    threads: list[str] = []

    def then(fut: Any) -> Any:
        threads.append(threading.current_thread().name)
        return dist.all_reduce(y, async_op=True).get_future().wait()

    t0 = time.monotonic()
    try:
        dist.all_reduce(x, async_op=True).get_future().then(then).wait()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - t0, "threads": threads,
            "y": y.tolist()}


def bad_switch_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """init_process_group with SWITCHML_SWITCH naming a port where nothing listens."""
    t0 = time.monotonic()
    try:
        _init("switchml", timeout_s=3.0)
    except Exception as exc:  # noqa: BLE001 - reported
        time.sleep(0.5)  # let a leaked I/O thread show itself
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0,
                "threads": [t.name for t in threading.enumerate()]}
    return {"error": None, "seconds": time.monotonic() - t0, "threads": []}
