"""Shared test set-up and helpers.

- The data plane is C built by ``pip install -e .``: a build older than its source
  (``src/switchml/csrc``) stops the run at once, saying how to rebuild it.
- ``@pytest.mark.root`` (tests that build network namespaces): skipped, saying why, without
  root or without ip/tc/nft (``switchml.testbed.check_environment``).
- Helpers shared by test files in several directories, as session fixtures whose value is the
  helper function (conftest modules are not importable by name from every test directory):
  free ports, ``python -m switchml`` processes, threads per rank, /proc look-ups.

Spawned process bodies (``*_procs.py``) cannot use fixtures: what they need lives in their own
module.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator

import pytest

SWITCHML = [sys.executable, "-m", "switchml"]


def pytest_sessionstart(session: pytest.Session) -> None:
    from pathlib import Path

    from switchml import _switch, _worker
    csrc = Path(__file__).resolve().parents[1] / "src" / "switchml" / "csrc"
    if csrc.is_dir():
        headers = max(p.stat().st_mtime for p in csrc.glob("*.h"))
        for name, built in (("worker", _worker.__file__), ("switch", _switch.__file__)):
            source = max(headers, (csrc / f"{name}.c").stat().st_mtime)
            if source > Path(built).stat().st_mtime:
                raise pytest.UsageError(
                    f"{built} is older than its source in {csrc}: rebuild it with `python "
                    "setup.py build_ext --inplace` (a few seconds) or `pip install -e .`")


# -- root tests ----------------------------------------------------------------------------------

@functools.cache
def testbed_missing() -> str | None:
    """Why the testbed cannot be built here (no root, no ip/tc/nft), or None."""
    from switchml.testbed import TestbedError, check_environment
    try:
        check_environment()
    except TestbedError as exc:
        return str(exc)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        reason = testbed_missing()
        if reason is not None:
            pytest.skip(reason)


OPTIONAL = {"matplotlib": "matplotlib", "sklearn": "scikit-learn", "torchft": "torchft==0.2.0",
            "lightning": "lightning", "accelerate": "accelerate", "cryptography": "cryptography"}
"""Packages of the ``test`` extra a test may need: where one is missing, a test that imports it
is skipped, naming it, rather than failing."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root not in OPTIONAL:
            raise
        pytest.skip(f"needs {OPTIONAL[root]}, which is not installed here (pip install -e "
                    '".[test]" installs it)')


# -- plain helpers (each also a fixture of the same name, below) ---------------------------------

def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_ports(1)[0]


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free UDP (and TCP, for metrics) ports."""
    for base in range(41000, 60000, 97):
        socks = []
        try:
            for i in range(count):
                for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                    s = socket.socket(socket.AF_INET, kind)
                    socks.append(s)
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def py(code: str) -> list[str]:
    """argv running ``code`` (dedented) in this interpreter."""
    return [sys.executable, "-c", textwrap.dedent(code)]


def run_switchml(*args: str, timeout: float = 60,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m switchml ARGS`` to the end, output captured as text."""
    return subprocess.run([*SWITCHML, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def run_threads(target: Callable[[int], object], n: int, timeout: float) -> None:
    """``target(i)`` for i in 0..n-1, each in a thread of its own; join each for ``timeout``."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def _proc_entries() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def child_pids(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in _proc_entries():
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.add(entry)
    return found


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def pids_with(args: list[str]) -> list[int]:
    """Processes whose command line holds ``args`` in a row (from /proc)."""
    found = []
    for entry in _proc_entries():
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(argv[i:i + len(args)] == args for i in range(len(argv))):
            found.append(entry)
    return found


# -- the fixtures --------------------------------------------------------------------------------

def _helper_fixture(fn: Callable) -> Callable:
    """A session fixture named like ``fn`` whose value is ``fn``."""
    def fixture() -> Callable:
        return fn
    fixture.__doc__ = fn.__doc__
    return pytest.fixture(scope="session", name=fn.__name__)(fixture)


free_ports_fixture = _helper_fixture(free_ports)
free_port_fixture = _helper_fixture(free_port)
free_port_range_fixture = _helper_fixture(free_port_range)
py_fixture = _helper_fixture(py)
run_switchml_fixture = _helper_fixture(run_switchml)
run_threads_fixture = _helper_fixture(run_threads)
child_pids_fixture = _helper_fixture(child_pids)
pid_alive_fixture = _helper_fixture(pid_alive)
pids_with_fixture = _helper_fixture(pids_with)


@pytest.fixture
def start_switchml() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """A function: ``start_switchml(*args, **popen_kw)`` starts ``python -m switchml ARGS``
    (stdout and stderr piped, text); whatever still runs at the test's end is killed."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, **popen_kw) -> subprocess.Popen[str]:
        kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen_kw}
        proc = subprocess.Popen([*SWITCHML, *args], **kw)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
