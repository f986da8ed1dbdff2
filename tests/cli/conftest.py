"""Helpers for the command tests: parse a command line, and run one with a library call
replaced by a recorder (the test then checks the config the command built)."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from typing import Any

import pytest

from switchml.cli import build_parser


@pytest.fixture
def parse() -> Callable[..., argparse.Namespace]:
    """``parse(*argv)``: the parsed ``switchml`` command line (the parser built now, so that
    environment defaults set by the test apply)."""
    def _parse(*argv: str) -> argparse.Namespace:
        return build_parser().parse_args(list(argv))
    return _parse


class Recorder:
    """A stand-in for a library function: records each call's arguments, returns ``value``."""

    def __init__(self, value: Any = None) -> None:
        self.value = value
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value

    @property
    def args(self) -> tuple[Any, ...]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0][0]

    @property
    def kwargs(self) -> dict[str, Any]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0][1]


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Recorder]:
    """``record(module, name, value)``: replace ``module.name`` by a :class:`Recorder`."""
    def _record(module: Any, name: str, value: Any = None) -> Recorder:
        rec = Recorder(value)
        monkeypatch.setattr(module, name, rec)
        return rec
    return _record


@pytest.fixture
def stopped_at_once(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """``stopped_at_once(module)``: the module's ``stop_on_signals`` returns an event that is
    already set (no signal handlers installed in the test process; foreground loops end)."""
    def _patch(module: Any) -> None:
        def _stop(what: str) -> threading.Event:
            stop = threading.Event()
            stop.set()
            return stop
        monkeypatch.setattr(module, "stop_on_signals", _stop)
    return _patch
