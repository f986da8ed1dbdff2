"""``switchml predict``: the profile of a real model, each all-reduce's time against hand
computations and the link bound, and DDP's overlap composed as a hand-worked example."""

from __future__ import annotations

import subprocess
import sys

import pytest

from switchml import predict as P
from switchml.protocol.wire import HEADER_SIZE


def _prof(buckets, f=0.01, b=0.1, o=0.02):
    return P.Profile(model="x", batch=1, params=sum(n for n, _ in buckets), forward_s=f,
                     backward_s=b, optimizer_s=o,
                     buckets=[P.Bucket(n, r) for n, r in buckets])


def test_buckets_overlap_backward_as_ddp_runs_them():
    # ready at 30 and 90 ms of a 100 ms backward, all-reduces of 50 and 40 ms: the first
    # ends at 80, the second waits for its gradients (90) and ends at 130, 30 ms after
    # backward: step = 10 + 100 + 30 + 20 ms.
    p = P.compose(_prof([(100, 0.03), (200, 0.09)]), [0.05, 0.04], "x")
    assert p.step_s == pytest.approx(0.16)
    assert p.exposed_s == pytest.approx(0.03)
    assert p.comm_s == pytest.approx(0.09)
    assert p.hidden == pytest.approx(2 / 3)
    # back to back: the second bucket waits for the first (ends 0.03 + 0.1 + 0.1)
    q = P.compose(_prof([(100, 0.03), (200, 0.04)]), [0.1, 0.1], "x")
    assert q.exposed_s == pytest.approx(0.13)


def test_on_cores_the_ranks_outnumber_no_all_reduce_overlaps_backward(monkeypatch):
    # The example above (ready at 30 and 90 ms of a 100 ms backward, all-reduces of 50 and
    # 40 ms) without overlap: both run after backward, ending at 150 and 190 ms: exposed 90,
    # step 10 + 100 + 90 + 20 ms.
    p = P.compose(_prof([(100, 0.03), (200, 0.09)]), [0.05, 0.04], "x", overlap=False)
    assert p.exposed_s == pytest.approx(0.09) and p.step_s == pytest.approx(0.22)
    # With the hook's division (100 ns per element, buckets of 100k and 200k elements: 30 ms
    # on backward's thread), backward ends at 130 ms, and both all-reduces follow it: they end
    # at 180 and 220 ms; exposed 90, step 10 + 130 + 90 + 20 ms.
    prof = _prof([(100_000, 0.03), (200_000, 0.09)])
    prof.div_ns = 100.0
    q = P.compose(prof, [0.05, 0.04], "switchml", overlap=False)
    assert q.exposed_s == pytest.approx(0.09) and q.step_s == pytest.approx(0.25)
    # predict composes so when the job's processes (4 ranks and a switch) outnumber the cores
    # (2 or 4), and overlaps when each has a core.
    monkeypatch.setattr(P, "switchml_allreduce_s", lambda numel, **kw: 0.05 if numel == 100
                        else 0.04)
    prof = _prof([(100, 0.03), (200, 0.09)])
    prof.colocated = 4
    exposed = {cores: P.predict(prof, workers=4, rate_bps=1e9, systems=("switchml",),
                                res=P.Resources(cores=cores))[0].exposed_s
               for cores in (2, 4, 5, None)}
    assert exposed[2] == pytest.approx(0.09) and exposed[4] == pytest.approx(0.09)
    assert exposed[5] == pytest.approx(0.03) and exposed[None] == pytest.approx(0.03)


def test_the_hooks_work_on_backwards_thread_delays_later_buckets_and_backward():
    # As above (ready at 30 and 90 ms of a 100 ms backward, all-reduces of 50 and 40 ms),
    # with 100 ns per element of division and, for the 16-bit hook, 100 more of adding the
    # residual: buckets of 100k and 200k elements. 32-bit: the first bucket is handed over
    # 10 ms late (40, ends 90), the second 30 ms (120, ends 160); backward ends at 130:
    # exposed 30, step 10 + 130 + 30 + 20 ms. 16-bit: delays 20 and 60 ms, backward 160,
    # the all-reduces end at 100 and 190: exposed 30, step 220 ms.
    prof = _prof([(100_000, 0.03), (200_000, 0.09)])
    prof.div_ns, prof.add_ns = 100.0, 100.0
    p32 = P.compose(prof, [0.05, 0.04], "switchml")
    assert p32.exposed_s == pytest.approx(0.03) and p32.step_s == pytest.approx(0.19)
    p16 = P.compose(prof, [0.05, 0.04], "switchml16")
    assert p16.exposed_s == pytest.approx(0.03) and p16.step_s == pytest.approx(0.22)


def test_the_slowest_ranks_compute_sets_the_pace():
    # The example above with a lockstep of 0.26 s against a free step of 0.13 s (slowdown 2):
    # forward 20, backward 200 ms; the buckets are ready at 60 and 180 ms, the all-reduces
    # end at 110 and 220: exposed 20, step 20 + 200 + 20 + 40 ms.
    prof = _prof([(100, 0.03), (200, 0.09)])
    prof.period_s, prof.lockstep_s = 0.13, 0.26
    assert prof.slowdown == pytest.approx(2.0)
    p = P.compose(prof, [0.05, 0.04], "x")
    assert p.exposed_s == pytest.approx(0.02) and p.step_s == pytest.approx(0.28)
    prof.lockstep_s = 0.1  # faster than running free: measurement noise
    assert prof.slowdown == 1.0


def test_hybrid_sends_factors_on_the_shared_link_and_rebuilds_after_backward(monkeypatch):
    # One 100 x 100 layer fed K = 2 rows, n = 4: aggregating moves 2 x 10,000 x 4 = 80 kB,
    # its factors 2 x 3 x 2 x 200 x 4 = 9.6 kB: factors. Its bias (100 elements) is the only
    # bucket, ready at 5 ms, all-reduced in 4 ms (the simulator, replaced here): on the link
    # from 5 to 9 ms. The gather starts at 10 ms: 3 blocks of 1,600 bytes in TCP segments at
    # 1 Mbit/s, 1600 x 3 x 1538 / 1448 x 8 / 1e6 s, plus 3 ring steps of 100 us. Backward
    # ends at 50 ms; the rebuild (10,000 elements x (10 ns + 4 x 2 x 1 ns)) follows the
    # gather's end.
    monkeypatch.setattr(P, "switchml_allreduce_s", lambda numel, **kw: 0.004)
    prof = _prof([], f=0.01, b=0.05, o=0.01)
    prof.layers = [P.Layer("fc", 100, 100, 2, 0.01)]
    prof.params_ready = [P.Param(100, 0.005), P.Param(10_000, 0.02, layer=0)]
    prof.rebuild_out_ns, prof.mac_ns = 10.0, 1.0
    decisions, buckets = P.hybrid_plan(prof, workers=4)
    assert [d.path for d in decisions] == ["sfb"] and buckets == [(100, 0.005)]
    gather = 1600 * 3 * 1538 / 1448 * 8 / 1e6 + 3 * 100e-6
    rebuild = 10_000 * (10 + 4 * 2 * 1) * 1e-9
    p = P.compose_hybrid(prof, workers=4, rate_bps=1e6, mtu=1500)
    assert p.comm_s == pytest.approx(0.004 + gather)
    assert p.exposed_s == pytest.approx(0.01 + gather - 0.05)
    assert p.step_s == pytest.approx(0.01 + (0.01 + gather) + rebuild + 0.01)
    # at 100 Mbit/s the gather hides behind backward: the step is compute and the rebuild
    fast = P.compose_hybrid(prof, workers=4, rate_bps=1e8, mtu=1500)
    assert fast.exposed_s == 0.0 and fast.step_s == pytest.approx(0.07 + rebuild)


def test_hybrid_transfers_queue_on_the_link_and_the_waits_keep_hybrids_order(monkeypatch):
    # As above, with the bias's all-reduce taking 60 ms (on the link from 5 to 65 ms) and the
    # layer's output gradient known at 6 ms: its gather waits for the link and ends at
    # 65 ms + gather. One pass over a gradient costs 1 us per element: backward loses DDP's
    # two copies of the 10,000 weights sent by factors (50 - 20 = 30 ms); the rebuild is
    # followed by its division and copy (20 ms); then the bucket's division (0.1 ms).
    monkeypatch.setattr(P, "switchml_allreduce_s", lambda numel, **kw: 0.06)
    prof = _prof([], f=0.01, b=0.05, o=0.01)
    prof.layers = [P.Layer("fc", 100, 100, 2, 0.006)]
    prof.params_ready = [P.Param(100, 0.005), P.Param(10_000, 0.02, layer=0)]
    prof.rebuild_out_ns, prof.mac_ns, prof.div_ns = 10.0, 1.0, 1000.0
    gather = 1600 * 3 * 1538 / 1448 * 8 / 1e6 + 3 * 100e-6
    rebuild = 10_000 * (10 + 4 * 2 * 1) * 1e-9 + 2 * 10_000 * 1e-6
    p = P.compose_hybrid(prof, workers=4, rate_bps=1e6, mtu=1500)
    assert p.exposed_s == pytest.approx(0.065 + gather - 0.03)
    assert p.step_s == pytest.approx(0.01 + (0.065 + gather) + rebuild + 100e-6 + 0.01)


def test_hybrid_aggregates_layers_whose_factors_cost_more(monkeypatch):
    # K = 1,000 rows of a 100 x 100 layer: factors 2 x 3 x 1000 x 200 x 4 = 4.8 MB against
    # 80 kB: aggregated with its bias, one bucket ready when both are (20 ms).
    monkeypatch.setattr(P, "switchml_allreduce_s", lambda numel, **kw: numel * 1e-6)
    prof = _prof([], f=0.0, b=0.05, o=0.0)
    prof.layers = [P.Layer("fc", 100, 100, 1000, 0.01)]
    prof.params_ready = [P.Param(100, 0.005), P.Param(10_000, 0.02, layer=0)]
    decisions, buckets = P.hybrid_plan(prof, workers=4)
    assert [d.path for d in decisions] == ["aggregate"] and buckets == [(10_100, 0.02)]
    p = P.compose_hybrid(prof, workers=4, rate_bps=1e9, mtu=1500)
    assert p.comm_s == pytest.approx(0.0101) and p.exposed_s == 0.0


def test_gloo_is_a_ring_in_tcp_segments():
    # 1M floats, 4 workers: 2 x 3/4 x 4 MB each way, in 1448-byte segments that cost
    # 1448 + 52 + 38 bytes of wire, at 1 Gbit/s, plus 6 hops of 100 us.
    wire = 4e6 * 1.5 * (1448 + 52 + 38) / 1448
    assert P.gloo_allreduce_s(1_000_000, workers=4, rate_bps=1e9, mtu=1500) == \
        pytest.approx(wire * 8 / 1e9 + 6 * 100e-6)
    assert P.gloo_allreduce_s(1_000_000, workers=1, rate_bps=1e9, mtu=1500) == 0.0


def test_switchml_time_is_near_its_link_bound_and_16_bits_halve_it():
    numel = 2_000_000
    t32 = P.switchml_allreduce_s(numel, workers=4, rate_bps=1e9, mtu=1500)
    # The simulator's links count what tbf shapes: the IP packet and a 14-byte Ethernet
    # header. 2M elements in ceil(2M / 358) datagrams of 358 (one short), each with the
    # switchml header and 28 bytes of IP and UDP headers.
    packets = -(-numel // 358)
    bound = (numel * 4 + packets * (HEADER_SIZE + 28 + 14)) * 8 / 1e9
    assert bound <= t32 < 1.15 * bound, (t32, bound)
    t16 = P.switchml_allreduce_s(numel, workers=4, rate_bps=1e9, mtu=1500, bits=16)
    assert 0.45 < t16 / t32 < 0.6
    # a ring moves 2 (n - 1) / n = 1.5x the bytes: the switch is faster on the same links
    assert t32 < P.gloo_allreduce_s(numel, workers=4, rate_bps=1e9, mtu=1500)


def test_profile_of_a_real_model_covers_every_parameter():
    prof = P.profile("cnn", 16, steps=4)
    # conv 1x32x3x3 + 32, conv 32x64x3x3 + 64, linear 1024x512 + 512, linear 512x10 + 10
    assert sum(b.numel for b in prof.buckets) == prof.params == 320 + 18_496 + 524_800 + 5_130
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.optimizer_s > 0
    assert all(0 <= b.ready_s <= prof.backward_s for b in prof.buckets)
    # a free step is the compute and the batch's preparation (within the noise of
    # millisecond-long steps)
    assert prof.compute_s < 1.2 * prof.period_s
    # HybridDataParallel's view: both Linear layers, fed the batch's 16 rows, and every
    # parameter's gradient
    assert [(x.in_features, x.out_features, x.rows) for x in prof.layers] == \
        [(1024, 512, 16), (512, 10, 16)]
    assert sum(p.numel for p in prof.params_ready) == prof.params
    assert all(0 <= p.ready_s <= prof.backward_s for p in prof.params_ready)
    assert all(0 <= x.grad_s <= prof.backward_s for x in prof.layers)
    assert sorted(p.layer for p in prof.params_ready if p.layer is not None) == [0, 1]
    # one process: no lockstep to measure
    assert prof.lockstep_s is None and prof.slowdown == 1.0
    preds = {p.system: p for p in P.predict(prof, workers=4, rate_bps=1e8)}
    assert set(preds) == set(P.SYSTEMS) and preds["gloo"].speedup == 1.0
    # at 100 Mbit/s, 2 MB of gradient: communication dominates, and switchml's saving shows
    assert preds["switchml"].speedup > 1.1 and preds["switchml16"].speedup > \
        preds["switchml"].speedup


def test_profiling_waits_on_the_barrier_after_every_step():
    import time

    class SlowBarrier:  # the others' compute: 50 ms after each step
        waits = 0

        def wait(self):
            SlowBarrier.waits += 1
            time.sleep(0.05)

    import torch
    threads = torch.get_num_threads()
    try:
        doc = P._profile_here("cnn", 16, 5, 0, barrier=SlowBarrier())
    finally:
        torch.set_num_threads(threads)  # (profiling sets one thread, as a worker runs)
    # to start each phase together, after every step, and before timing the hooks' work
    assert SlowBarrier.waits == 2 + 5 + 1
    assert doc["lockstep_s"] >= doc["period_s"] + 0.045


def test_a_profiling_process_that_fails_fails_the_profile_at_once(tmp_path, monkeypatch):
    # one of three processes raises while the others profile and then wait for it at the
    # barrier: its error comes back at once, not after the timeout
    import time
    monkeypatch.setenv("SWITCHML_TEST_FAIL_ONCE", str(tmp_path / "failed"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="fails on purpose"):
        P.profile("predict_factories:fails_in_one_process", 16, steps=3, colocated=3,
                  timeout_s=120)
    assert time.monotonic() - t0 < 60


def test_wrong_arguments_say_what_is_wrong():
    prof = _prof([(10, 0.0)])
    with pytest.raises(ValueError, match="unknown system"):
        P.predict(prof, workers=4, rate_bps=1e9, systems=("nccl",))
    with pytest.raises(ValueError, match="workers must be >= 1"):
        P.predict(prof, workers=0, rate_bps=1e9)
    with pytest.raises(ValueError, match="unknown workload 'resnet'"):
        P.profile("resnet")


def test_the_command_prints_a_verdict():
    out = subprocess.run([sys.executable, "-m", "switchml", "predict", "--model", "cnn",
                          "--steps", "3", "--rate-mbit", "100"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "switchml16" in out.stdout and "speedup vs gloo" in out.stdout
    assert "switchml helps" in out.stdout


def test_validate_profiles_each_model_once_for_about_two_seconds_of_its_steps(monkeypatch):
    """``predict --against``: one profile per (model, batch, workers), as many steps as fit
    in ``PROFILE_S`` of the measured step (8 at least, ``PROFILE_STEPS_MAX`` at most: a 25 ms
    model profiled in 8 steps measured its lockstep anywhere from 14 to 28 ms), and each
    row's error against its measured step."""
    asked = []

    def fake_profile(model, batch, *, colocated, steps):
        asked.append((model, steps, colocated))
        return _prof([(1000, 0.05)], f=0.01, b=0.1, o=0.02)

    monkeypatch.setattr(P, "profile", fake_profile)
    free = P.Costs(0, 0, 0, 0, 0)

    def row(model, system, step_s):
        return {"model": model, "system": system, "batch": 32, "workers": 1, "rate_bps": 1e9,
                "mtu": 1500, "step_s": step_s}

    out = P.validate([row("cnn", "gloo", 0.05), row("cnn", "switchml", 0.05),
                      row("ncf", "gloo", 0.5), row("tiny", "gloo", 1e-4),
                      row("ncf", "noop", 0.1)], costs=free)
    assert asked == [("cnn", 40, 1), ("ncf", 8, 1), ("tiny", P.PROFILE_STEPS_MAX, 1)]
    # one worker, free CPU: nothing to all-reduce, the step is the profile's 130 ms
    assert [r["system"] for r in out] == ["gloo", "switchml", "gloo", "gloo"]
    assert out[0]["predicted_step_s"] == pytest.approx(0.13)
    assert out[0]["error"] == pytest.approx(0.13 / 0.05 - 1)
