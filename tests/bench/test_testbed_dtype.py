"""Half-precision all-reduces over the testbed (root): switchml through its torch backend
against gloo on the same type. bfloat16 over three ranks travels as 16-bit fixed point: the
workers' links carry about half the bytes that float32 takes, the sums are exact."""

from __future__ import annotations

import pytest


def test_half_types_are_checked_before_the_testbed_is_built():
    from switchml.bench.testbed import TestbedBenchConfig
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16"):
        TestbedBenchConfig(dtype="int8")
    with pytest.raises(ValueError, match="only the systems switchml and gloo run"):
        TestbedBenchConfig(dtype="bfloat16", systems=("switchml", "ps"))
    with pytest.raises(ValueError, match="the backend sets the wire width"):
        TestbedBenchConfig(dtype="float16", systems=("switchml",), bits=16)
    with pytest.raises(ValueError, match="overflow float16"):  # 10 * 4**7 > 65504
        TestbedBenchConfig(dtype="float16", systems=("gloo",), workers=4, warmup=1, iters=7)
    with pytest.raises(ValueError, match=r"through torch \(dtype float32\)"):
        TestbedBenchConfig(torch=True, systems=("switchml", "floor"))
    assert TestbedBenchConfig(torch=True, systems=("switchml", "gloo")).through_torch
    assert not TestbedBenchConfig().through_torch


def test_the_command_offers_the_types_the_benchmark_takes():
    """``--dtype``'s choices are written in the CLI (it imports the benchmark only when it
    runs): they must be the benchmark's."""
    import argparse

    from switchml.bench.testbed import DTYPES
    from switchml.cli import build_parser

    def sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return subs.choices[name]
    allreduce = sub(sub(build_parser(), "bench"), "allreduce")
    (dtype,) = [a for a in allreduce._actions if a.dest == "dtype"]
    assert tuple(dtype.choices) == DTYPES


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bfloat16_through_the_backend_takes_16_bits_and_sums_exactly():
    from switchml.bench.testbed import TestbedBenchConfig, run_testbed_allreduce
    size = 4 << 20
    rows = run_testbed_allreduce(TestbedBenchConfig(
        workers=3, sizes_bytes=(size,), iters=2, warmup=1, systems=("switchml", "gloo"),
        dtype="bfloat16"))
    by = {r["system"]: r for r in rows}
    sml = by["switchml"]
    assert sml["dtype"] == "bfloat16" and sml["wire_bits"] == 16
    assert sml["max_abs_error"] == 0.0
    # each worker sent 3 operations of size / 4 elements, 2 bytes each (float32: 4)
    assert sml["payload_bytes_sent"] == [3 * size // 4 * 2] * 3
    assert by["gloo"]["ate_per_s"] > 0 and sml["ate_per_s"] > 0


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_float32_through_the_backend_with_torch_sums_exactly():
    """``--torch``: float32 through ``dist.all_reduce`` on a "switchml" group (32 bits on the
    wire), the row marked as such."""
    from switchml.bench.testbed import TestbedBenchConfig, run_testbed_allreduce
    size = 4 << 20
    rows = run_testbed_allreduce(TestbedBenchConfig(
        workers=3, sizes_bytes=(size,), iters=2, warmup=1, systems=("switchml",), torch=True))
    (sml,) = rows
    assert sml["through_torch"] and sml["wire_bits"] == 32
    assert sml["max_abs_error"] == 0.0
    assert sml["payload_bytes_sent"] == [3 * size] * 3
