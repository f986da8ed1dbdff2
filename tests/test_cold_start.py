"""Nothing compiles at run time: the data plane is C, built by ``pip install``.

* A fresh process that runs a switch, a worker, the torch-free transports and the CLI never
  imports numba (it is not a dependency any more; a first all-reduce once waited 56-61 s for
  it on a fresh install, and failed before that).
* The README's numpy example from fresh processes: ``switchml switch``, then two ranks that
  all-reduce as soon as it says it listens, with operations that time out after 3 s (a switch
  that compiled on its first datagrams, about 14 s here, failed them), returns the right sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

README_RANKS = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from switchml.control import new_job_spec, encode_job_spec, decode_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.udp import WorkerClient

    switch = ("127.0.0.1", int(sys.argv[1]))
    config = WorkerConfig(op_timeout_s=float(sys.argv[2]))
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
    assert "numba" not in sys.modules
    assert "ml_dtypes" not in sys.modules  # (half a second to import: only for bfloat16)
    print("sum ok")
""")


def test_the_data_plane_imports_no_compiler() -> None:
    code = ("import sys, switchml.transport.udp, switchml.transport.parallel, switchml.cli, "
            "switchml.protocol.tree; assert 'numba' not in sys.modules, 'numba imported'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_ml_dtypes_is_imported_only_for_bfloat16() -> None:
    """Importing ml_dtypes takes about 0.6 s here (more than torch's core): a process that
    runs a switch, a worker or the torch backend without bfloat16 never imports it, and a
    bfloat16 array is still taken once the caller has it (which means ml_dtypes is loaded)."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import switchml.cli, switchml.transport.udp, switchml.transport.parallel
        import switchml.cli.switch, switchml.service, switchml.transport.server  # (a switch)
        import switchml.torch
        from switchml.protocol.errors import LocalProtocolError
        from switchml.protocol.operation import validate_arrays
        from switchml.protocol.dtypes import is_float, kernel_view
        for dt in (np.float16, np.float32, np.float64, np.int32):
            validate_arrays(np.zeros(4, dt), np.zeros(4, dt))
        try:
            validate_arrays(np.zeros(4, np.int16), np.zeros(4, np.int16))
            raise SystemExit("int16 taken")
        except LocalProtocolError as exc:
            assert "bfloat16" in str(exc) and "int16" in str(exc), exc
        assert "ml_dtypes" not in sys.modules, "imported before bfloat16 was used"
        import ml_dtypes
        bf = np.zeros(4, ml_dtypes.bfloat16)
        validate_arrays(bf, bf.copy())
        assert is_float(bf.dtype) and kernel_view(bf).dtype == np.uint16
        assert not is_float(np.dtype(np.int32))
        assert kernel_view(np.zeros(2, np.float16)).dtype == np.float16
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:] + out.stdout


def test_the_bfloat16_checks_hold_while_another_thread_imports_ml_dtypes() -> None:
    """ml_dtypes is in ``sys.modules`` before its import has made ``bfloat16``: a worker's
    I/O thread that checks a dtype meanwhile (a user's thread importing it for its first
    bfloat16 tensor) must not fail. (It raised AttributeError in 5 runs of 5 when the check
    read ``bfloat16`` from any module it found.)"""
    code = textwrap.dedent("""
        import threading
        import numpy as np
        from switchml.protocol.dtypes import is_float, is_supported, kernel_view
        a, errors, stop = np.zeros(4, np.int32), [], threading.Event()

        def check():
            while not stop.is_set():
                try:
                    kernel_view(a), is_float(a.dtype), is_supported(np.dtype("V2"))
                except Exception as exc:
                    errors.append(repr(exc))
                    return

        t = threading.Thread(target=check)
        t.start()
        import ml_dtypes
        stop.set()
        t.join()
        assert not errors, errors
        assert is_float(np.dtype(ml_dtypes.bfloat16))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:] + out.stdout


@pytest.mark.slow
def test_readme_numpy_example_answers_at_once_from_fresh_processes(free_port) -> None:
    port = free_port()
    t0 = time.monotonic()
    switch = subprocess.Popen([sys.executable, "-m", "switchml", "switch", "--port", str(port),
                               "--metrics-port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = switch.stdout.readline()  # the listening line
        assert "listening" in line, (line, switch.stderr.read() if switch.poll() else "")
        listening_s = time.monotonic() - t0
        ranks = subprocess.run([sys.executable, "-c", README_RANKS, str(port), "3"],
                               env=dict(os.environ), capture_output=True, text=True,
                               timeout=120)
        assert ranks.returncode == 0, ranks.stderr[-3000:]
        assert "sum ok" in ranks.stdout
        print(f"switch listening after {listening_s:.1f} s, first all-reduce returned after "
              f"{time.monotonic() - t0:.1f} s")
    finally:
        switch.kill()
        switch.wait(timeout=10)
