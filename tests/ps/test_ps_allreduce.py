"""The parameter-server all-reduce (the benchmarks' baseline) sums exactly, step after step."""

from __future__ import annotations

import numpy as np

from switchml.ps.allreduce import PSAllreduce, sum_server


def test_sum_server_all_reduces_repeatedly(run_threads):
    server = sum_server(port=0, workers=3, host="127.0.0.1")
    outs: dict[int, list[np.ndarray]] = {}

    def worker(r: int) -> None:
        ar = PSAllreduce([server.address], worker=r, numel=1000, workers=3)
        got = []
        for step in range(3):
            out = np.empty(1000, np.float32)
            ar(np.full(1000, (r + 1) * (step + 1), np.float32), out)
            got.append(out)
        outs[r] = got
        ar.close()

    run_threads(worker, 3, 30)
    assert server.wait_finished(10)
    server.stop()
    for r in range(3):
        assert [o[0] for o in outs[r]] == [6.0, 12.0, 18.0]
        assert all((o == o[0]).all() for o in outs[r])
