"""The compiled kernels, ready before anything needs them.

The worker's data plane is C, compiled when the package is built (``switchml._worker``): a
worker has nothing to compile. The switch's and a rack switch's kernels are still numba
functions, compiled on a machine's first use and cached next to their source
(``__pycache__``); a later process loads them in about a second. This module decides when
that happens in a process, so that no operation waits for the compiler:

* :func:`ensure_switch`: ``SwitchServer`` calls it before it binds its socket (a switch says
  it listens only once it can answer at once); :func:`ensure_tree` for a rack switch.
* :func:`ensure_worker`: nothing (the worker's kernels are built with the package).

Each runs once per process; where it takes longer than a moment (a compile) the log says so,
and how long it took. ``python -m switchml.warmup`` compiles everything ahead, in parallel.

Numba's cache notices a change to a kernel's own file only, not to the kernels or wire
constants it uses from another file. :func:`clear_stale_caches` keeps a digest per compiled
module over the module and the package files it imports (transitively, read from its import
statements) and removes that module's cached kernels when the digest changed: an edit to the
worker's ``stream.py`` recompiles the worker's kernels, not the switch's.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["clear_stale_caches", "compiled_modules", "dependencies", "ensure_switch",
           "ensure_tree", "ensure_worker"]

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]
_SLOW_S = 2.0
"""A step that takes longer than this says in the log that it is compiling."""


# -- numba's cache on disk -----------------------------------------------------------------------

def compiled_modules() -> list[Path]:
    """The source files that hold numba kernels (their caches are cleared when stale): the
    switch's and a rack's (the worker's are C, built with the package)."""
    kernels = _PACKAGE / "protocol" / "kernels"
    return [kernels / "aggregate.py", kernels / "frames.py", kernels / "relay.py",
            _PACKAGE / "transport" / "switchpath.py"]


def _module_file(name: str) -> Path | None:
    """The file of package module ``switchml.a.b`` (a package: its ``__init__.py``)."""
    if not name.startswith("switchml."):
        return None
    base = _PACKAGE.joinpath(*name.split(".")[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path) -> set[Path]:
    """The package files ``path`` imports at module level (``from switchml.x import y``,
    where ``y`` may itself be a module, and ``import switchml.x``)."""
    found: set[Path] = set()
    for node in ast.parse(path.read_text()).body:
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            f = _module_file(name)
            if f is not None:
                found.add(f)
    return found


def dependencies(path: Path) -> list[Path]:
    """``path`` and every package file it imports, transitively, sorted."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo.extend(_imports(f) - seen)
    return sorted(seen)


def clear_stale_caches() -> list[str]:
    """Remove the cached kernels of every compiled module whose sources (the module and what it
    imports) changed since they were cached; return the modules cleared. Only numba's default
    cache, next to the sources, is looked at; nothing happens where it is not writable."""
    cleared = []
    for module in compiled_modules():
        digest = hashlib.sha256()
        for src in dependencies(module):
            digest.update(str(src.relative_to(_PACKAGE)).encode() + b"\0" + src.read_bytes())
        cache = module.parent / "__pycache__"
        stamp = cache / f"{module.stem}.sources.sha256"
        try:
            if stamp.exists() and stamp.read_text() == digest.hexdigest():
                continue
            stale = [*cache.glob(f"{module.stem}.*.nbi"), *cache.glob(f"{module.stem}.*.nbc")]
            for f in stale:
                f.unlink()
            if stale:
                cleared.append(module.stem)
            cache.mkdir(exist_ok=True)
            stamp.write_text(digest.hexdigest())
        except OSError:
            continue
    return cleared


# -- once per process ----------------------------------------------------------------------------

_lock = threading.RLock()
_ready: set[object] = set()


def _once(key: object, what: str, run: Callable[[], None]) -> None:
    """Run ``run`` once per process (the first caller runs it; others wait for it). If it takes
    longer than a moment, the log says it is compiling and, at the end, how long it took."""
    if key in _ready:
        return
    with _lock:
        if key in _ready:
            return
        if "stale" not in _ready:
            cleared = clear_stale_caches()
            if cleared:
                log.info("switchml: kernel sources changed: recompiling %s", ", ".join(cleared))
            _ready.add("stale")
        t0 = time.monotonic()
        note = threading.Timer(_SLOW_S, log.warning, (
            "switchml: compiling the %s kernels for this machine (once: they are cached "
            "after; `python -m switchml.warmup` compiles them all ahead)", what))
        note.daemon = True
        note.start()
        try:
            run()
        finally:
            note.cancel()
        took = time.monotonic() - t0
        if took > _SLOW_S:
            log.warning("switchml: %s kernels compiled in %.1f s", what, took)
        _ready.add(key)


def ensure_switch() -> None:
    """The switch's kernels (the in-process rules and the compiled loop), compiled or loaded."""
    from switchml.protocol.warmup import warm_switch
    from switchml.transport.switchpath import warm_up as warm_switch_path

    def run() -> None:
        warm_switch()
        warm_switch_path()
    _once("switch", "switch", run)


def ensure_tree() -> None:
    """A rack switch's relay kernels (and the switch's)."""
    from switchml.protocol.warmup import warm_tree
    ensure_switch()
    _once("tree", "rack switch", warm_tree)


def ensure_worker(dtype: np.dtype | type = np.float32, bits: int = 32,
                  residual: bool = False) -> None:
    """A worker's kernels for one kind of operation: nothing to do. They are C, compiled when
    the package is built (``switchml._worker``, from ``src/switchml/csrc/worker.c``), and
    loaded with it; kept so that callers need not know which data plane is compiled when."""
    del dtype, bits, residual
