"""The compiled kernels are ready before anything needs them (``transport/compiled.py``).

* Cold start: with numba's cache empty (a fresh install), the README's numpy example (a
  ``switchml switch``, then two ranks that all-reduce as soon as it says it listens) returns the
  right sum. It once failed: the switch said it listened, then compiled on its first datagrams
  and answered no JOIN for longer than the workers' join timeout.
* A stale cache is cleared per module, by what the module imports: an edit to the switch's
  kernels leaves a rack's cached relay kernels alone, and an edit to the wire table clears every
  kernel that compiles its offsets in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from switchml.transport import compiled

SRC = Path(compiled.__file__).resolve().parents[1]

README_RANKS = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from switchml.control import new_job_spec, encode_job_spec, decode_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.udp import WorkerClient

    switch = ("127.0.0.1", int(sys.argv[1]))
    config = WorkerConfig(op_timeout_s=float(sys.argv[2])) if len(sys.argv) > 2 else None
    text = encode_job_spec(new_job_spec(num_workers=2, switch=switch))
    out, errors = {}, []

    def rank(r):
        try:
            with WorkerClient(switch, decode_job_spec(text), rank=r, config=config) as w:
                out[r] = w.allreduce(np.full(1_000_000, r + 1, np.float32))
        except BaseException as exc:
            errors.append(f"rank {r}: {exc!r}")

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors
    assert all(bool((out[r] == 3).all()) for r in range(2)), {r: out[r][:4] for r in out}
    print("sum ok")
""")


def _cold_switch_then_ranks(tmp_path, port: int, ranks_env: dict, *ranks_args: str) -> float:
    """A ``switchml switch`` with an empty kernel cache; once it says it listens, the README's
    two ranks (``ranks_env``). Returns the seconds from the switch's start to the sum."""
    switch_env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "switch-cache")}
    t0 = time.monotonic()
    switch = subprocess.Popen([sys.executable, "-m", "switchml", "switch", "--port", str(port),
                               "--metrics-port", "0"], env=switch_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = switch.stdout.readline()  # the listening line
        assert "listening" in line, (line, switch.stderr.read() if switch.poll() else "")
        listening_s = time.monotonic() - t0
        ranks = subprocess.run([sys.executable, "-c", README_RANKS, str(port), *ranks_args],
                               env=ranks_env, capture_output=True, text=True, timeout=400)
        total_s = time.monotonic() - t0
        assert ranks.returncode == 0, ranks.stderr[-3000:]
        assert "sum ok" in ranks.stdout
        print(f"switch listening after {listening_s:.1f} s, first all-reduce returned after "
              f"{total_s:.1f} s")
        return total_s
    finally:
        switch.kill()
        switch.wait(timeout=10)


@pytest.mark.slow
def test_a_switch_that_says_it_listens_answers_at_once(tmp_path, free_port) -> None:
    """The switch's cache is empty, the ranks' is warm (the session's warm-up), and their
    operations time out after 3 s: a switch that compiled on its first datagrams (about 14 s
    here) failed them."""
    _cold_switch_then_ranks(tmp_path, free_port(), dict(os.environ), "3")


@pytest.mark.slow
def test_readme_numpy_example_works_with_an_empty_kernel_cache(tmp_path, free_port) -> None:
    """Everything cold, as after a fresh install."""
    _cold_switch_then_ranks(tmp_path, free_port(), {
        **os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "ranks-cache")})


def test_dependencies_follow_the_imports() -> None:
    """Read by hand from the sources' import lines."""
    kernels = SRC / "protocol" / "kernels"
    deps = {p.name for p in compiled.dependencies(kernels / "stream.py")}
    assert {"stream.py", "frames.py", "numerics.py", "wire.py"} <= deps
    assert "aggregate.py" not in deps and "timers.py" not in deps
    deps = {p.name for p in compiled.dependencies(kernels / "aggregate.py")}
    assert {"aggregate.py", "frames.py", "slots.py", "wire.py"} <= deps
    assert "stream.py" not in deps and "numerics.py" not in deps
    fast = {str(p.relative_to(SRC)) for p in compiled.dependencies(
        SRC / "transport" / "switchpath.py")}
    for module in ("aggregate", "frames", "layout"):
        assert f"protocol/kernels/{module}.py" in fast  # through ``kernels as K``
    for module in ("relay", "stream", "timers", "numerics"):
        # (the package's __init__ leaves out the relay and the worker's reference kernels)
        assert f"protocol/kernels/{module}.py" not in fast


def _fake_cache(package: Path) -> dict[str, Path]:
    """One cache entry per compiled module, named as numba names them."""
    made = {}
    for module in compiled.compiled_modules():
        assert module.is_relative_to(package)
        cache = module.parent / "__pycache__"
        cache.mkdir(exist_ok=True)
        entry = cache / f"{module.stem}.kernel-10.py311.nbi"
        entry.write_bytes(b"x")
        made[module.stem] = entry
    return made


def test_an_edit_clears_only_the_caches_of_modules_that_use_it(tmp_path, monkeypatch) -> None:
    package = tmp_path / "switchml"
    shutil.copytree(SRC, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(compiled, "_PACKAGE", package)
    _fake_cache(package)
    compiled.clear_stale_caches()  # no stamps yet: everything counts as stale, once
    entries = _fake_cache(package)
    assert compiled.clear_stale_caches() == []
    assert all(e.exists() for e in entries.values())

    with open(package / "protocol" / "kernels" / "stream.py", "a") as f:
        f.write("\n# an edit\n")  # the worker's reference kernels: no numba kernel uses them
    assert compiled.clear_stale_caches() == []
    with open(package / "protocol" / "kernels" / "aggregate.py", "a") as f:
        f.write("\n# an edit\n")
    cleared = compiled.clear_stale_caches()
    assert sorted(cleared) == ["aggregate", "switchpath"]
    for stem, entry in entries.items():
        assert entry.exists() == (stem not in cleared), stem

    entries = _fake_cache(package)
    with open(package / "protocol" / "wire.py", "a") as f:
        f.write("\n# an edit\n")
    assert sorted(compiled.clear_stale_caches()) == sorted(entries)  # all compile its offsets
    assert not any(e.exists() for e in entries.values())
