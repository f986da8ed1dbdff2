"""Process harness and process bodies for the PyTorch backend tests.

Children import this module by name (pytest puts ``tests/torch`` on ``sys.path``, and the fork
server that starts them has it), so process bodies live here and in the sibling modules
(``backend_checks``, ``hybrid_procs``).

Parent side: :class:`Procs` starts processes (from a fork server: ``CTX``), tags every one of
them with an environment variable that their own children (the embedded switch) inherit, gives
every wait a hard deadline, and on exit kills whatever is left and reports leftover tagged
processes, so a test can assert that no switch outlived its group.

Child side: :func:`rank_main` sets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and
runs a body ``body(rank, world, q, *args)``; the body's return value (picklable, no tensors:
tensors cross the queue as numpy arrays) goes to the parent as ``("result", rank, value)``, an
exception as ``("error", rank, traceback)``.
"""

from __future__ import annotations

import contextlib
import datetime
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

TAG_ENV = "SWITCHML_TORCH_TEST_TAG"
CTX = mp.get_context("forkserver")
"""Ranks start from a fork server (one clean, single-threaded process, started at the first
test that needs it) that has torch and switchml imported already: a rank starts in well under
a second, where a spawned one imported torch afresh (3-4 s of the 2-core machine each). Each
child takes its parent's environment as it is at the start (``_tagged_entry``), as a spawned
one would."""
CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy", "switchml.torch",
                            "torch_procs", "backend_checks", "hybrid_procs", "hook_procs"])


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
        p = CTX.Process(target=_tagged_entry, args=(self.tag, dict(os.environ), target, args),
                        daemon=True)
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

def _tagged_entry(tag: str, environ: dict[str, str], target: Callable[..., Any],
                  args: tuple) -> None:
    os.environ.clear()  # the parent's environment now, not the fork server's at its start
    os.environ.update(environ)
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


# -- body: DDP training on gloo, switchml, switchml ----------------------------------------------

def _ddp_train(rank: int, steps: int, hook: str | None = None) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 3))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    if hook is not None:
        from switchml.torch.hooks import register_hook
        register_hook(ddp, hook)
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


def hook_failover_body(rank: int, world: int, q: Any, timeout_s: float, steps: int,
                       hook: str) -> dict[str, Any]:
    """DDP with ``hook`` on the default group (``SWITCHML_FAILOVER=gloo``; the quorum hook
    with ``SWITCHML_QUORUM``), ``steps`` steps 50 ms apart, through an external switch the
    test kills once every rank reported step 5; each step's seconds, the final model, the
    stats, and the hook's state's bucket counts."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import switchml.torch as stt
    from switchml.torch.hooks import register_hook

    _init("switchml", timeout_s=timeout_s)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    ddp = DDP(model, bucket_cap_mb=0.005)  # several buckets
    state = register_hook(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    seconds = []
    for step in range(steps):
        xb, yb = torch.randn(32, 20, generator=g), torch.randn(32, 3, generator=g)
        t0 = time.monotonic()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xb), yb).backward()
        opt.step()
        seconds.append(time.monotonic() - t0)
        if step == 5:
            q.put(("progress", rank, step))
        time.sleep(0.05)
    run = {"final": torch.cat([p.detach().ravel() for p in model.parameters()]).numpy(),
           "seconds": seconds, "stats": stt.stats(),
           "hook_buckets": getattr(state, "buckets", None)}
    dist.destroy_process_group()
    return run


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


def switch_server_body(q: Any, port: int = 0, secret: bytes | None = None) -> None:
    """A SwitchServer in a process of its own (SIGKILLed by the test)."""
    from switchml.protocol.config import SwitchConfig
    from switchml.transport.udp import SwitchServer

    server = SwitchServer(host="127.0.0.1", port=port,
                          config=SwitchConfig(secret=secret)).start()
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


def tenant_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """One all-reduce on the default group (SWITCHML_TENANT and SWITCHML_TENANT_KEY set by the
    test): its sum, and the group's job id."""
    import torch
    import torch.distributed as dist

    _init("switchml", timeout_s=20)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    job = dist.distributed_c10d._get_default_group().client.spec.job_id
    dist.destroy_process_group()
    return {"sum": x.tolist()[:3], "job": job}


def auth_data_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """Two all-reduces on the default group (SWITCHML_AUTH_DATA set by the test): their sums,
    whether the group's job authenticates its data plane, and the worker's MAC drops."""
    import torch
    import torch.distributed as dist

    _init("switchml", timeout_s=20)
    x = torch.arange(5000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    y = torch.full((3,), rank + 1, dtype=torch.int32)
    dist.all_reduce(y)
    client = dist.distributed_c10d._get_default_group().client
    out = {"x": x[:4].tolist(), "x_last": float(x[-1]), "y": y.tolist(),
           "auth": client.spec.auth_data, "k": client.spec.elements_per_packet,
           "bad_mac": client.endpoint.drops["bad_mac"]}
    dist.destroy_process_group()
    return out


def rank0_refuses_body(rank: int, world: int, q: Any, timeout_s: float) -> dict[str, Any]:
    """Form the default group with a setting rank 0 refuses (the test's environment): what
    each rank raised, and how long it took."""
    import time as _time
    t0 = _time.monotonic()
    try:
        _init("switchml", timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}", "took_s": _time.monotonic() - t0}
    return {"error": None, "took_s": _time.monotonic() - t0}


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


def _train_sharded(net: Any, rank: int, steps: int) -> list[float]:
    """``steps`` steps of AdamW on random regression data seeded by ``rank``; the losses."""
    import torch

    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    device = next(net.parameters()).device  # fully_shard puts them on a GPU where there is one
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randn(8, 4, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp_body(rank: int, world: int, q: Any, backend: str, version: int, steps: int
              ) -> dict[str, Any]:
    """Train a small MLP sharded with FSDP (``version`` 2: ``fully_shard`` on each Linear and
    the model; 1: ``FullyShardedDataParallel``) and AdamW on ``backend``; return the full
    parameters after ``steps`` steps (gathered) and the losses."""
    import torch
    import torch.distributed as dist

    _init(backend, timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    if version == 2:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        net = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        net = FSDP(model, use_orig_params=True)
    losses = _train_sharded(net, rank, steps)
    if version == 2:
        full = [p.full_tensor().detach().clone() for p in net.parameters()]
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        with FSDP.summon_full_params(net):
            full = [p.detach().clone() for p in net.parameters()]
    flat = torch.cat([t.reshape(-1) for t in full]).tolist()
    dist.destroy_process_group()
    return {"params": flat, "losses": losses}


def stall_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """Rank 1 reaches the second all-reduce 5 s late. Rank 0, waiting in it, returns what its
    watchdog logged, its flight records meanwhile and after, and what SIGUSR1 dumped."""
    import io
    import logging
    import signal
    import sys

    import torch
    import torch.distributed as dist

    import switchml.torch as stt

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("switchml.torch").addHandler(Keep())
    _init("switchml", timeout_s=60)
    dist.all_reduce(torch.ones(10))
    x = torch.full((50_000,), float(rank))
    if rank == 1:
        time.sleep(5.0)
        dist.all_reduce(x)
        dist.destroy_process_group()
        return {}
    work = dist.all_reduce(x, async_op=True)
    time.sleep(4.0)
    during = stt.flight_records()
    dumped = io.StringIO()
    old, sys.stderr = sys.stderr, dumped
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)  # the handler runs on the main thread between bytecodes
    finally:
        sys.stderr = old
    work.wait()
    after = stt.flight_records()
    dist.destroy_process_group()
    return {"log": lines, "during": during, "after": after, "dump": dumped.getvalue(),
            "sum": float(x[0])}


def hsdp_body(rank: int, world: int, q: Any, backend: str, steps: int,
              reduce_dtype: str | None = None) -> dict[str, Any]:
    """HSDP: ``fully_shard`` over a 2-D DeviceMesh (replicate x shard) of 2 x 2 ranks, AdamW,
    ``steps`` steps, gradients reduced in ``reduce_dtype`` if given (FSDP2's
    ``MixedPrecisionPolicy``); returns the full parameters, the losses, and (switchml) how
    many all-reduces each of this rank's mesh groups sent through the switch and the payload
    bytes the replicate group's worker sent."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import switchml.torch as stt

    _init(backend, timeout_s=60)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    policy = MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype
                                  else None)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    losses = _train_sharded(model, rank, steps)
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    switched, sent = {}, None
    if backend == "switchml":
        for dim in ("replicate", "shard"):
            switched[dim] = stt.stats(mesh[dim].get_group())["switch_ops"].get("allreduce", 0)
        sent = stt.stats(mesh["replicate"].get_group())["worker"]["payload_bytes_sent"]
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"params": full.tolist(), "losses": losses, "switched": switched,
            "replicate_bytes_sent": sent, "shard_numel": shard_numel}


def cuda_body(rank: int, world: int, q: Any) -> dict[str, Any]:
    """All-reduces of CUDA tensors on the "switchml" backend (the host-copy path): float32,
    bfloat16 and a non-contiguous view, SUM and AVG, each left on its device with the sum;
    then DDP over a CUDA model with the switchml hook. Returns what each check found."""
    import torch
    import torch.distributed as dist

    from switchml.torch.hooks import register_hook

    _init("switchml", timeout_s=60)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}
    n = 100_003
    total = sum(range(1, world + 1))
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        x = torch.full((n,), float(rank + 1), dtype=dtype, device=dev)
        ptr = x.data_ptr()
        dist.all_reduce(x)
        out[name] = (x.device.type, x.dtype == dtype, x.data_ptr() == ptr,
                     float((x.double() - total).abs().max()))
    base = torch.arange(3 * n, dtype=torch.float32, device=dev).reshape(3, n) * (rank + 1)
    view = base[:, ::2]  # non-contiguous
    dist.all_reduce(view, op=dist.ReduceOp.AVG)
    want = torch.arange(3 * n, dtype=torch.float64, device=dev).reshape(3, n)[:, ::2] \
        * total / world
    untouched = base[:, 1::2] == torch.arange(3 * n, dtype=torch.float32, device=dev).reshape(
        3, n)[:, 1::2] * (rank + 1)
    out["view"] = (float((view.double() - want).abs().max() / want.abs().max()),
                   bool(untouched.all()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev])
    register_hook(ddp, "switchml")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=g).to(dev)
    for _ in range(3):
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
    out["params"] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).tolist()
    dist.destroy_process_group()
    return out


# -- body: a quorum group with a straggler ---------------------------------------------------------

def quorum_body(rank: int, world: int, q: Any, quorum: int, slow_rank: int, delay_s: float,
                steps: int, quorum_min: int | None = None,
                deadline_s: float | None = None) -> dict[str, Any]:
    """All-reduces (AVG) over ``switchml.torch.new_quorum_group(quorum)`` while ``slow_rank``
    sleeps ``delay_s`` before each; then DDP training over the group with ``quorum_hook``,
    the slow rank sleeping before each backward; then an exact all-reduce on the default
    group. Returns each step's result and time, the trained parameters and the exact sum."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import switchml.torch
    from switchml.torch.hooks import quorum_hook

    _init("switchml", timeout_s=20.0)
    group = switchml.torch.new_quorum_group(quorum, quorum_min=quorum_min, deadline_s=deadline_s)
    sums, seconds = [], []
    for _ in range(steps):
        if rank == slow_rank:
            time.sleep(delay_s)
        t = torch.full((20000,), float(rank + 1))
        t0 = time.monotonic()
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
        seconds.append(time.monotonic() - t0)
        sums.append(t.numpy().copy())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    net = DDP(model, process_group=group)
    net.register_comm_hook(group, quorum_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    step_s = []
    for _ in range(steps):
        loss = net(torch.randn(32, 16, generator=g)).square().mean()
        opt.zero_grad()
        if rank == slow_rank:
            time.sleep(delay_s)
        t0 = time.monotonic()
        loss.backward()
        opt.step()
        step_s.append(time.monotonic() - t0)
    params = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    exact = torch.full((10,), float(rank + 1))
    dist.all_reduce(exact)  # the default group: no quorum, every rank
    stats = switchml.torch.stats(group)
    dist.destroy_process_group()
    return {"sums": sums, "seconds": seconds, "step_s": step_s, "params": params,
            "exact": exact.numpy(), "stats": stats}


def quorum_dying_body(rank: int, world: int, q: Any, die_rank: int, die_step: int,
                      steps: int) -> dict[str, Any]:
    """DDP over a quorum group of ``world - 1`` with ``quorum_hook``; ``die_rank`` exits
    abruptly (``os._exit``) before step ``die_step``'s backward. The others report their
    trained parameters and each step's time."""
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import switchml.torch
    from switchml.torch.hooks import quorum_hook

    _init("switchml", timeout_s=20.0)
    group = switchml.torch.new_quorum_group(world - 1,
                                            timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    net = DDP(model, process_group=group)
    net.register_comm_hook(group, quorum_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    step_s = []
    for step in range(steps):
        loss = net(torch.randn(32, 16, generator=g)).square().mean()
        opt.zero_grad()
        if rank == die_rank and step == die_step:
            exit_now(q, ("died", rank, step))
        t0 = time.monotonic()
        loss.backward()
        opt.step()
        step_s.append(time.monotonic() - t0)
    params = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    exit_now(q, ("result", rank, {"params": params, "step_s": step_s,
                                  "stats": switchml.torch.stats(group)}))
    return {}


def failover_body(rank: int, world: int, q: Any, timeout_s: float, ops: int,
                  switch_for: dict[int, str], hook: str | None = None) -> dict[str, Any]:
    """``ops`` all-reduces (SUM and AVG, one chunk and many) with exact expected sums, 50 ms
    apart, through an external switch the test kills once every rank reported op 5; then
    DDP training (with ``hook``, a DDP hook by name). ``switch_for``: another switch address
    for some ranks (a relay)."""
    import torch
    import torch.distributed as dist

    import switchml.torch as stt

    if rank in switch_for:
        os.environ["SWITCHML_SWITCH"] = switch_for[rank]
    _init("switchml", timeout_s=timeout_s)
    exact, seconds = [], []
    for i in range(ops):
        n = 300 if i % 2 or switch_for else 30_000
        # int32 travels in one datagram per block (a float block needs its exponent's first)
        integer = bool(switch_for) or i % 4 == 2
        x = torch.full((n,), rank + 1 + i % 5,
                       dtype=torch.int32 if integer else torch.float32)
        avg = i % 3 == 0
        t0 = time.monotonic()
        dist.all_reduce(x, op=dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM)
        seconds.append(time.monotonic() - t0)
        total = world * (world + 1) // 2 + world * (i % 5)
        expect = (total // world if integer else total / world) if avg else total
        exact.append(bool((x == expect).all()))
        if i == 5:
            q.put(("progress", rank, i))
        time.sleep(0.05)
    run = _ddp_train(rank, 3, hook)
    run.update(exact=exact, seconds=seconds, stats=stt.stats())
    dist.destroy_process_group()
    return run
