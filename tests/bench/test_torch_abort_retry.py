"""A benchmark run whose process aborted in torch's C++ is run once more, and only that:
``bench.testbed.once_more_if_torch_aborted``, which bench allreduce (gloo), bench train and
bench geo run their rows through."""

from __future__ import annotations

import pytest

from switchml.bench.testbed import once_more_if_torch_aborted
from switchml.testbed import TestbedError


def _runs(*outcomes):
    """A run that fails or returns each of ``outcomes`` in turn, counting its calls."""
    calls = []

    def run():
        outcome = outcomes[len(calls)]
        calls.append(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return run, calls


# what _wait_all raised in a training run (torch 2.13 printed nothing else)
ABORTED = TestbedError("a benchmark process failed (-6): terminate called without an active "
                       "exception")


def test_an_abort_is_run_again_once_after_the_hook(caplog):
    run, calls = _runs(ABORTED, "row")
    before = []
    assert once_more_if_torch_aborted(run, "training cnn on gloo",
                                      lambda: before.append(len(calls))) == "row"
    assert len(calls) == 2 and before == [1]  # the hook ran between the two tries
    assert "training cnn on gloo: a process aborted in torch's C++" in caplog.text


def test_other_failures_and_a_second_abort_are_raised():
    run, calls = _runs(TestbedError("a benchmark process failed (1): Traceback ..."), "row")
    with pytest.raises(TestbedError, match="Traceback"):
        once_more_if_torch_aborted(run, "x")
    assert len(calls) == 1
    run, calls = _runs(ValueError("not the testbed's"), "row")
    with pytest.raises(ValueError):
        once_more_if_torch_aborted(run, "x")
    run, calls = _runs(ABORTED, ABORTED, "row")
    with pytest.raises(TestbedError, match="terminate called"):
        once_more_if_torch_aborted(run, "x")
    assert len(calls) == 2
