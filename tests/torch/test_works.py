"""``torch/works.py``: the combined work of a coalesced collective done one tensor at a time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from switchml.torch.works import all_of


class _Part(dist.Work):
    """A finished gloo-like work that counts its waits (a CUDA one synchronizes there)."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__()
        self.waited = 0
        self.future: torch.futures.Future = torch.futures.Future()
        if error is None:
            self.future.set_result([torch.zeros(1)])
        else:
            self.future.set_exception(RuntimeError(error))

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def,override]
        self.waited += 1
        return True


def test_waiting_for_the_whole_waits_for_every_part():
    # FSDP2 waits on the coalesced all-gather's work: each gloo part's own wait() must run
    # (on CUDA tensors it is what makes the caller's stream wait for the copy back).
    parts = [_Part(), _Part()]
    work = all_of(parts, "outputs")
    assert work.wait() is True
    assert [p.waited for p in parts] == [1, 1]
    assert work.get_future().value() == "outputs"


def test_a_failed_part_fails_the_whole():
    work = all_of([_Part(), _Part("gloo broke")], None)
    with pytest.raises(RuntimeError, match="gloo broke"):
        work.wait()


class _Handle:
    def __init__(self, error=None):
        self._error = error

    def exception(self):
        return self._error


def test_bucket_done_completes_with_the_bucket_or_the_error_naming_the_hook():
    """A hook's done-callback: the write-back runs, then DDP's future gets the bucket; an
    all-reduce that failed, or a write-back that raised, reaches it as an error naming the
    hook (never a future nobody completes)."""
    from switchml.torch.works import bucket_done, failable_future
    bucket = torch.ones(3)
    wrote = []
    for handle, finish, expect in [
            (_Handle(), wrote.append, None),
            (_Handle(RuntimeError("no answer from the switch")), wrote.append,
             "my hook failed: no answer from the switch"),
            (_Handle(), lambda h: 1 / 0, "my hook failed: division by zero")]:
        completer, future = failable_future()
        bucket_done(completer, bucket, finish, "my hook")(handle)
        if expect is None:
            assert future.wait() is bucket and wrote == [handle]
        else:
            with pytest.raises(RuntimeError, match=expect):
                future.wait()
    assert len(wrote) == 1  # (a failed all-reduce writes nothing back)
