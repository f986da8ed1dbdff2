"""The configuration objects (``protocol/config.py``) refuse a value of the wrong type by its
field's name: a string, a float where an integer belongs, a bool for a count, text for a
secret, before a rule compares it (a TypeError) or the wire packs it (a struct.error on the
I/O thread, as a float ``num_workers`` once failed a join)."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.errors import ConfigError


@pytest.mark.parametrize("make, message", [
    (lambda: JobSpec(1, 2, num_workers=2.5), "num_workers must be an integer, got 2.5 (float)"),
    (lambda: JobSpec(1, 2, num_workers="2"), "num_workers must be an integer, got '2' (str)"),
    (lambda: JobSpec(1, 2, num_workers=True), "num_workers must be an integer, got True"),
    (lambda: JobSpec(1, 2, 2, window=2.0), "window must be an integer, got 2.0"),
    (lambda: JobSpec("1", 2, 2), "job_id must be an integer, got '1'"),
    (lambda: SwitchConfig(pool_slots=1.5), "pool_slots must be an integer, got 1.5"),
    (lambda: SwitchConfig(lease_timeout_s="30"), "lease_timeout_s must be a number, got '30'"),
    (lambda: WorkerConfig(op_timeout_s="5"), "op_timeout_s must be a number, got '5'"),
    (lambda: WorkerConfig(secret="a secret as text"), "secret must be bytes or None, got"),
    (lambda: WorkerConfig(threads=1.0), "threads must be an integer or None, got 1.0"),
])
def test_a_value_of_the_wrong_type_is_refused_by_its_field(make, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_numbers_of_the_right_kind_pass_whatever_their_python_type():
    # numpy integers are integers, and an integer is a number of seconds
    spec = JobSpec(np.uint32(1), np.uint64(2), num_workers=np.int64(3), window=np.int32(4))
    assert (spec.num_workers, spec.window) == (3, 4)
    assert WorkerConfig(op_timeout_s=30, quorum_keep_bytes=0).op_timeout_s == 30
    assert SwitchConfig(lease_timeout_s=5, secret=bytes(16)).lease_timeout_s == 5
