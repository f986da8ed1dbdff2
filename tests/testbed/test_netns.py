"""The testbed for real (root): rates, loss, exact switchml over shaped lossy links, teardown."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from switchml.testbed import LinkSpec, Testbed, TestbedError, Topology

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_link_rate_is_within_ten_percent(tcp_rate):
    rate = 200e6
    with Testbed(Topology(workers=2, link=LinkSpec(bandwidth_bps=rate, mtu=1500))) as tb:
        measured, _ = tcp_rate(tb, tb.worker_ns(0), tb.worker_ns(1), tb.topology.worker_ip(1),
                               5201, 3.0)
        # worker 0 -> switch -> worker 1 crosses two shaped links; the rate is the link's
        assert 0.9 * rate <= measured <= 1.1 * rate, measured
        assert "tbf" in tb.qdisc(tb.router_ns, f"{tb.prefix}s1")


def test_loss_is_applied_at_the_asked_rate_once_per_link(py):
    """Worker 0 to the switch (uplink: the router's input rule), the switch to worker 0
    (downlink: worker 0's input rule) and worker 0 to worker 1 (two links: the router's forward
    rule, then worker 1's input rule); the nft counters of all tables add up to the drops."""
    loss, count = 0.05, 20_000
    with Testbed(Topology(workers=2, link=LinkSpec(bandwidth_bps=None, loss_rate=loss))) as tb:
        topo = tb.topology
        assert tb.switch_ns == tb.router_ns  # the switch is the router
        paths = [(tb.worker_ns(0), tb.switch_ns, topo.switch_ip(0), 1),
                 (tb.switch_ns, tb.worker_ns(0), topo.worker_ip(0), 1),
                 (tb.worker_ns(0), tb.worker_ns(1), topo.worker_ip(1), 2)]
        counted = 0
        for src, dst, ip, links in paths:
            sink = tb.popen(dst, py("""
                import socket, json
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
                s.bind(("0.0.0.0", 6000)); s.settimeout(1.0); print("ready", flush=True)
                n = 0
                try:
                    while True: s.recv(2048); n += 1
                except socket.timeout: pass
                print(json.dumps({"received": n}))
            """), stdout=subprocess.PIPE, text=True)
            assert sink.stdout.readline().strip() == "ready"
            tb.run(src, py(f"""
                import socket, time
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                for i in range({count}):
                    s.sendto(b"x" * 100, ("{ip}", 6000))
                    if i % 1000 == 999: time.sleep(0.01)
            """))
            received = json.loads(sink.stdout.readline())["received"]
            sink.wait(timeout=10)
            dropped = count - received
            p = 1 - (1 - loss) ** links
            sigma = (count * p * (1 - p)) ** 0.5
            assert abs(dropped - count * p) <= 5 * sigma, (src, dst, dropped, count * p)
            counted += dropped
            assert tb.loss_counter() == counted, (src, dst)


GSO_SENDER = """
    import socket, struct, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("{dst}", 6000))
    anc = [(17, 103, struct.pack("=H", {size}))]  # SOL_UDP, UDP_SEGMENT
    for r in range({runs}):
        s.sendmsg([b"".join(struct.pack("!I", r * {n} + i) + bytes({size} - 4)
                            for i in range({n}))], anc)
        time.sleep(0.002)
"""

GRO_RECEIVER = """
    import json, socket, struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
    s.setsockopt(17, 104, 1)  # SOL_UDP, UDP_GRO
    s.bind(("0.0.0.0", 6000)); s.settimeout(2.0); print("ready", flush=True)
    buf = bytearray(1 << 16); seen = []; batches = []
    try:
        while True:
            n, anc, _, _ = s.recvmsg_into([buf], socket.CMSG_SPACE(4))
            seg = n
            for level, kind, data in anc:
                if (level, kind) == (17, 104):
                    seg = struct.unpack("=i", data[:4])[0] if len(data) >= 4 else n
            ids = [struct.unpack_from("!I", buf, off)[0] for off in range(0, n, seg)]
            seen += ids; batches.append(len(ids))
    except socket.timeout:
        pass
    print(json.dumps({"seen": seen, "batches": batches}))
"""


def _gso_through_the_testbed(py, tb: Testbed, runs: int, n: int, size: int,
                             to_switch: bool = True) -> dict:
    """GSO runs from worker 0 to the switch (router namespace), or from the switch to
    worker 0."""
    src, dst = tb.worker_ns(0), tb.switch_ns
    ip = tb.topology.switch_ip(0)
    if not to_switch:
        src, dst, ip = dst, src, tb.topology.worker_ip(0)
    before = tb.loss_counter()
    sink = tb.popen(dst, py(GRO_RECEIVER), stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    tb.run(src, py(GSO_SENDER.format(dst=ip, runs=runs, n=n, size=size)))
    res = json.loads(sink.stdout.readline())
    res["nft_drops"] = tb.loss_counter() - before
    return res


def test_batching_is_on_and_gso_runs_are_lost_per_datagram(py):
    """A GSO run of n datagrams crosses worker 0's link at loss 0.5, up (to the switch: the
    router's input rule) and down (from the switch: worker 0's input rule): about half of
    each run arrives (not all or nothing, as when the link carried the run as one packet) and
    the loss counters count datagrams. With XDP loss (before GRO) the receivers still get GRO
    batches; at loss 0 a worker receives a whole run in one recvmsg."""
    import shutil
    if shutil.which("ethtool") is None:
        pytest.skip("ethtool missing (Debian package ethtool): the testbed turns batching off")
    runs, n, loss = 50, 40, 0.5
    with Testbed(Topology(workers=1, link=LinkSpec(bandwidth_bps=None, loss_rate=loss))) as tb:
        assert tb.batching
        for to_switch in (True, False):
            res = _gso_through_the_testbed(py, tb, runs, n, 1000, to_switch)
            seen = res["seen"]
            assert len(seen) == len(set(seen))  # no duplicates
            total, received = runs * n, len(seen)
            sigma = (total * loss * (1 - loss)) ** 0.5
            assert abs(received - total * loss) <= 5 * sigma, (to_switch, received, total)
            # one count per dropped datagram
            assert res["nft_drops"] == total - received, (to_switch, res["nft_drops"])
            per_run = [sum(1 for x in seen if x // n == r) for r in range(runs)]
            # whole-run drops would leave 0 or n of a run; per-datagram loss leaves some of
            # each (a run of 40 arrives whole or not at all with probability 2 ** -39)
            assert all(0 < k < n for k in per_run), (to_switch, per_run)
            if tb.loss_by == "xdp":  # loss before GRO: the receiver still gets batches
                assert max(res["batches"]) > 1, (to_switch, res["batches"])
        env = tb.popen(tb.worker_ns(0), [sys.executable, "-c", "import os; print("
                       "os.environ.get('SWITCHML_GSO', ''))"], stdout=subprocess.PIPE, text=True)
        assert env.communicate(timeout=30)[0].strip() == ""  # switchml's batching stays on
    with Testbed(Topology(workers=1, link=LinkSpec(bandwidth_bps=1e9))) as tb:
        res = _gso_through_the_testbed(py, tb, 20, n, 1000, to_switch=False)
        assert sorted(res["seen"]) == list(range(20 * n))
        assert max(res["batches"]) == n, res["batches"]  # a whole run in one recvmsg
        assert res["nft_drops"] == 0
        assert "smlloss" not in tb.run(tb.worker_ns(0), ["nft", "list", "ruleset"])


def test_default_links_have_ethernets_mtu():
    with Testbed(Topology(workers=1)) as tb:
        for ns, dev in ((tb.worker_ns(0), "h0"), (tb.router_ns, "s0"), (tb.ps_ns, "h250")):
            out = subprocess.run(["ip", "-n", ns, "link", "show", "dev", f"{tb.prefix}{dev}"],
                                 capture_output=True, text=True).stdout
            assert " mtu 1500 " in out, out


def test_switchml_is_exact_over_shaped_lossy_links(py):
    from switchml.control import encode_job_spec, new_job_spec
    from switchml.control.announce import parse_listening
    n = 3
    spec = encode_job_spec(new_job_spec(n, window=8, elements_per_packet=2200))
    link = LinkSpec(bandwidth_bps=300e6, loss_rate=0.01, mtu=9000)
    with Testbed(Topology(workers=n, link=link)) as tb:
        switch = tb.popen(tb.switch_ns, [sys.executable, "-m", "switchml.bench.nsproc", "switch",
                                         json.dumps({"port": 48864})],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # it says it listens as `switchml switch` does (control.announce)
        assert parse_listening(switch.stdout.readline()) == ("0.0.0.0", 48864)
        procs = [tb.popen(tb.worker_ns(r), py(f"""
            import numpy as np
            from switchml.control import decode_job_spec
            from switchml.transport.udp import WorkerClient
            spec = decode_job_spec("{spec}")
            with WorkerClient(("{tb.topology.switch_ip(r)}", 48864), spec, {r}) as w:
                for op in range(4):
                    rng = np.random.default_rng(op)
                    xs = rng.integers(-2**20, 2**20, ({n}, 300_000), dtype=np.int32)
                    out = w.allreduce(xs[{r}])
                    assert np.array_equal(out, xs.sum(axis=0, dtype=np.int32)), op
                c = w.counters
                print(c.get("retransmissions", 0), c["send_calls"], c["packets_sent"])
        """), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
        retransmissions = 0
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            retx, calls, sent = map(int, out.strip().splitlines()[-1].split())
            retransmissions += retx
            if tb.batching:  # GSO is on inside the testbed: fewer calls than datagrams
                assert calls < sent, (calls, sent)
            else:
                assert calls >= sent, (calls, sent)
        assert retransmissions > 0  # the loss really happened and was recovered
        assert tb.loss_counter() > 0


def test_teardown_removes_exactly_what_was_created(namespaces):
    before = namespaces()
    with Testbed(Topology(workers=2)) as tb:
        created = set(tb.namespaces)
        assert created <= namespaces() and len(created) == 4  # 2 workers, rt, ps
        assert created == {tb.worker_ns(0), tb.worker_ns(1), tb.router_ns, tb.ps_ns}
    assert namespaces() == before
    with pytest.raises(RuntimeError, match="boom"), Testbed(Topology(workers=1)) as tb:
        created = set(tb.namespaces)
        raise RuntimeError("boom")
    assert namespaces() == before
    # no veth was ever created in the root namespace
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tb.prefix not in links


def test_failed_command_raises_with_its_stderr():
    with pytest.raises(TestbedError, match="mtu must be|failed"):
        with Testbed(Topology(workers=1, link=LinkSpec(mtu=65535))) as tb:
            tb.run(tb.switch_ns, ["ip", "link", "set", "nonexistent0", "up"])


def test_a_killed_run_is_cleaned_up_by_the_next_and_a_live_one_is_left_alone(py, namespaces):
    """kill -9 skips the teardown: the namespaces, and a process running in one, outlive the
    owner. cleanup_stale (which every new testbed runs first) removes them, and only them."""
    import os
    import signal
    import time

    from switchml.testbed import cleanup_stale
    from switchml.testbed.netns import CLAIMS_DIR

    owner = subprocess.Popen(py("""
        import subprocess, sys, time
        from switchml.testbed import Testbed, Topology
        tb = Testbed(Topology(workers=1)).__enter__()
        tb.popen(tb.worker_ns(0), ["sleep", "300"])
        print(tb.prefix, flush=True)
        time.sleep(300)
    """), stdout=subprocess.PIPE, text=True)
    prefix = owner.stdout.readline().strip()
    assert prefix, "the owner did not build its testbed"
    stale = {f"{prefix}rt", f"{prefix}w0", f"{prefix}ps"}
    try:
        assert stale <= namespaces()
        with Testbed(Topology(workers=1)) as live:
            assert cleanup_stale() == []  # the owner is alive: nothing is touched
            assert stale <= namespaces()
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=10)
            sleeper = subprocess.run(["ip", "netns", "pids", f"{prefix}w0"], capture_output=True,
                                     text=True).stdout.split()
            assert sleeper, "the process in the namespace should have outlived its owner"
            assert sorted(cleanup_stale()) == sorted(stale)
            assert not stale & namespaces()
            assert set(live.namespaces) <= namespaces()  # the live testbed is intact
            assert not os.path.exists(os.path.join(CLAIMS_DIR, prefix))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and os.path.exists(f"/proc/{sleeper[0]}"):
                time.sleep(0.05)
            assert not os.path.exists(f"/proc/{sleeper[0]}"), "its process was not killed"
        assert not os.path.exists(os.path.join(CLAIMS_DIR, live.prefix))  # clean teardown
    finally:
        owner.kill()
        for ns in stale & namespaces():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_cleanup_command_reports_what_it_removed(run_switchml):
    res = run_switchml("testbed", "--cleanup")
    assert res.returncode == 0, res.stderr
    assert "stale namespace(s)" in res.stdout


def test_a_prefix_held_by_a_live_testbed_is_refused(namespaces):
    with Testbed(Topology(workers=1), prefix="smtestpx") as live:
        with pytest.raises(TestbedError, match="in use by a live testbed"):
            Testbed(Topology(workers=1), prefix="smtestpx").__enter__()
        assert set(live.namespaces) <= namespaces()  # untouched
    assert not {ns for ns in namespaces() if ns.startswith("smtestpx")}
