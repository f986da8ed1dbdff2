"""Shared by the root testbed tests: the skip marks, and small process helpers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from switchml.testbed import TestbedError, check_environment

try:
    check_environment()
    SKIP = None
except TestbedError as exc:
    SKIP = str(exc)

ROOT = [pytest.mark.root, pytest.mark.skipif(SKIP is not None, reason=f"{SKIP}")]
"""``pytestmark`` of a module whose tests build namespaces: skipped, saying why, without root
or without ip/tc/nft."""


def py(code: str) -> list[str]:
    """argv running ``code`` (dedented) in this interpreter."""
    return [sys.executable, "-c", textwrap.dedent(code)]


def namespaces() -> set[str]:
    """The network namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
