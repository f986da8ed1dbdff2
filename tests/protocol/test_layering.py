"""The protocol core is sans-I/O: no sockets, clocks, sleeps, threads, global RNG or processes.

Every ``.py`` under ``src/switchml/protocol`` is parsed with ``ast`` (no import side effects) and
each import is checked: no module from the forbidden list, and no ``switchml`` module outside
``switchml.protocol`` (the core must not depend on transports, the CLI or the torch plug-in).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import switchml.protocol

_SOURCE_TREE = Path(__file__).resolve().parents[2] / "src" / "switchml" / "protocol"
# The source tree when run from a checkout; the imported package otherwise (installed wheel).
PROTOCOL_DIR = (_SOURCE_TREE if _SOURCE_TREE.is_dir()
                else Path(switchml.protocol.__file__).resolve().parent)
FORBIDDEN = frozenset({"socket", "asyncio", "time", "random", "subprocess", "threading", "torch",
                       "os"})
PACKAGE = "switchml.protocol"


def _resolve_relative(module: str | None, level: int, path: Path) -> str:
    """Absolute name of ``from <level dots><module> import ...`` inside ``path``."""
    rel = path.relative_to(PROTOCOL_DIR).with_suffix("")
    parts = PACKAGE.split(".") + list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]  # a package's own __init__ is the package
    else:
        parts = parts[:-1]  # a module's package
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def imported_modules(source: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, including nested ones."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(node.module, node.level, path)
            else:
                base = node.module or ""
            if base == "switchml":
                # ``from switchml import transport`` imports the submodule switchml.transport
                found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, base))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "__import__" and node.args
              and isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def violations(source: str, path: Path) -> list[str]:
    bad = []
    for line, name in imported_modules(source, path):
        top = name.split(".")[0]
        if top in FORBIDDEN:
            bad.append(f"{path.name}:{line}: imports {name} (I/O, clock, threads or RNG)")
        elif top == "switchml" and name != PACKAGE and not name.startswith(PACKAGE + "."):
            bad.append(f"{path.name}:{line}: imports {name} (outside {PACKAGE})")
    return bad


def _sources() -> list[Path]:
    return sorted(PROTOCOL_DIR.rglob("*.py"))


def test_protocol_package_is_found():
    names = {p.name for p in _sources()}
    # the modules this rule is about exist (a wrong directory would pass vacuously)
    assert {"__init__.py", "wire.py", "switch.py", "worker.py", "quantize.py"} <= names


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PROTOCOL_DIR)))
def test_protocol_module_is_sans_io(path):
    assert violations(path.read_text(encoding="utf-8"), path) == []


# -- The checker itself -----------------------------------------------------------------------


@pytest.mark.parametrize("snippet", [
    "import socket",
    "import os.path",
    "from os import path",
    "import time as t",
    "from time import monotonic",
    "import random",
    "import asyncio",
    "import subprocess",
    "import threading",
    "import torch",
    "import torch.nn",
    "import json, socket",
    "def f():\n    import threading\n",
    "try:\n    import torch\nexcept ImportError:\n    pass\n",
    "if TYPE_CHECKING:\n    from socket import socket\n",
    "from switchml.transport import udp",
    "import switchml.transport.memory",
    "from switchml import transport",
    "import switchml.cli",
    "from .. import transport",
    "from ..transport.udp import UdpSwitch",
    "import switchml",
    "__import__('socket')",
])
def test_checker_catches(snippet):
    assert violations(snippet, PROTOCOL_DIR / "switch.py")


@pytest.mark.parametrize("snippet", [
    "import struct",
    "import numpy as np",
    "from collections import Counter",
    "import math, heapq",
    "from switchml.protocol.wire import Header",
    "from switchml.protocol import wire",
    "from switchml import protocol",
    "import switchml.protocol.errors",
    "from . import wire",
    "from .wire import Header",
    "from .errors import WireError",
    "import timeit",  # only exact module names are forbidden
    "import osmosis",
])
def test_checker_allows(snippet):
    assert violations(snippet, PROTOCOL_DIR / "switch.py") == []


def test_relative_imports_resolve():
    assert _resolve_relative("wire", 1, PROTOCOL_DIR / "switch.py") == "switchml.protocol.wire"
    assert _resolve_relative(None, 2, PROTOCOL_DIR / "switch.py") == "switchml"
    assert _resolve_relative("wire", 1, PROTOCOL_DIR / "__init__.py") == (
        "switchml.protocol.wire")
