"""Build a Topology in Linux network namespaces and tear down exactly what was built.

Every namespace name carries a per-run prefix, every object created is remembered, and teardown
(in ``__exit__``, on exceptions, on Ctrl-C and on SIGTERM through the CLI's handler) removes those
and nothing else: deleting a namespace removes its veth ends, qdiscs and nft tables with it.
Every ``ip``/``tc``/``nft`` failure raises :class:`TestbedError` with the command and its stderr;
each qdisc is read back after it is applied.

A run killed with SIGKILL cannot tear down. Each live testbed therefore holds a claim,
``/run/switchml-testbed/<prefix>``, locked with ``flock`` for its whole life (the kernel
releases the lock when the owner dies), and :func:`cleanup_stale` (run by every new testbed,
and by ``switchml testbed --cleanup``) removes the namespaces, and the processes in them, of
claims nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from switchml.protocol.errors import SwitchMLError
from switchml.testbed.topology import (
    GeoTopology,
    LinkSpec,
    Topology,
    ethtool_args,
    nft_host_loss_ruleset,
    nft_loss_ruleset,
    tbf_args,
)
from switchml.testbed.xdp import LossProgram

__all__ = ["GeoTestbed", "Testbed", "TestbedError", "check_environment", "cleanup_stale"]

log = logging.getLogger(__name__)
_TOOLS = ("ip", "tc", "nft")
CLAIMS_DIR = "/run/switchml-testbed"
LOSS_TABLE = "smlloss"
DELAY_TABLE = 100
"""The WAN core's routing table that sends packets from the data centres to the delay line."""


class TestbedError(SwitchMLError):
    """An environment problem: not root, a tool missing, or a command that failed."""

    __test__ = False  # not a pytest test class


def check_environment() -> None:
    """Raise TestbedError saying what is missing (root, ip, tc, nft)."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, tc, nftables); run "
                           "as root or use the loopback benchmarks instead")
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        raise TestbedError(f"missing tools: {', '.join(missing)} (Debian packages iproute2 and "
                           "nftables)")


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    res = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed ({res.returncode}): "
                           f"{res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


@contextlib.contextmanager
def _claims_lock() -> Iterator[None]:
    """Serialise cleanups and new claims (one lock file for the whole claims directory)."""
    os.makedirs(CLAIMS_DIR, exist_ok=True)
    fd = os.open(os.path.join(CLAIMS_DIR, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(ns: str) -> str | None:
    """Kill what runs in ``ns``, then delete it; returns an error message or None."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in (int(p) for p in pids.split() if p.isdigit()):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    res = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
    return None if res.returncode == 0 else f"{ns}: {res.stderr.strip()}"


def _cleanup_stale_locked() -> list[str]:
    removed: list[str] = []
    live = _namespaces()
    for prefix in sorted(c for c in os.listdir(CLAIMS_DIR) if not c.startswith(".")):
        path = os.path.join(CLAIMS_DIR, prefix)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner holds the lock: alive
            owner = os.read(fd, 64).decode(errors="replace").strip() or "?"
            # "sw": the switch host of testbeds built before the switch moved into the router
            # "d<j>": the data-centre routers of a GeoTestbed
            pattern = re.compile(rf"{re.escape(prefix)}(sw|rt|ps|w\d+|d\d+)")
            mine, errors = [], []
            for ns in live:
                if pattern.fullmatch(ns):
                    error = _delete_namespace(ns)
                    (errors if error else mine).append(error or ns)
            if errors:  # keep the claim: the next cleanup tries again
                log.warning("stale testbed %s: %s", prefix, "; ".join(errors))
            else:
                os.unlink(path)
            removed += mine
            log.info("removed stale testbed %s (owner pid %s gone): %s", prefix, owner,
                     ", ".join(mine) or "nothing left")
        finally:
            os.close(fd)
    return removed


def cleanup_stale() -> list[str]:
    """Remove the testbeds whose owner process is gone (killed before its teardown).

    A live testbed holds an exclusive ``flock`` on its claim ``CLAIMS_DIR/<prefix>`` for its
    whole life (the kernel drops it when the owner dies, however it dies); only namespaces of
    claims nobody holds are touched. Returns their names. Needs root.
    """
    if not os.path.isdir(CLAIMS_DIR):
        return []
    with _claims_lock():
        return _cleanup_stale_locked()


class Testbed:
    """A live Topology. Use as a context manager.

    Example::

        with Testbed(Topology(workers=4, link=LinkSpec(bandwidth_bps=1e9))) as tb:
            tb.run(tb.worker_ns(0), ["ping", "-c1", tb.topology.switch_ip(0)])
    """

    __test__ = False  # not a pytest test class

    def __init__(self, topology: Topology, prefix: str | None = None) -> None:
        self.topology = topology
        self.prefix = prefix or f"sm{secrets.token_hex(2)}"
        if len(self.prefix) > 8 or not self.prefix.isalnum():
            raise TestbedError(f"prefix must be 1..8 letters/digits, got {self.prefix!r}")
        self.namespaces: list[str] = []
        self._claim_fd: int | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self.batching = False
        """Whether processes started here may batch with UDP GSO/GRO (set when built: needs
        ethtool to make every veth carry single datagrams)."""
        self.loss_by = "none"
        """How loss is applied (set when built): ``"xdp"`` (before GRO, which stays on),
        ``"nftables"`` (after GRO, which is then off), or ``"none"``."""
        self._loss_program: LossProgram | None = None
        self._xdp_devices: list[tuple[str, str]] = []

    # -- names -------------------------------------------------------------------------------

    @property
    def switch_ns(self) -> str:
        """Where ``switchml switch`` runs: the router namespace (the switch is the router)."""
        return self.router_ns

    @property
    def router_ns(self) -> str:
        """The router: every link ends here, half the shaping and the uplink loss rules live
        here, and so does the switch."""
        return f"{self.prefix}rt"

    @property
    def ps_ns(self) -> str:
        return f"{self.prefix}ps"

    def worker_ns(self, i: int) -> str:
        return f"{self.prefix}w{i}"

    def host_device(self, i: int) -> str:
        """The network device of worker i inside its namespace."""
        return f"{self.prefix}h{i}"

    # -- life cycle --------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        check_environment()
        with _claims_lock():
            _cleanup_stale_locked()
            fd = os.open(os.path.join(CLAIMS_DIR, self.prefix), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise TestbedError(f"testbed prefix {self.prefix!r} is in use by a live "
                                   "testbed") from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._claim_fd = fd
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        topo, link = self.topology, self.topology.link
        self.batching = shutil.which("ethtool") is not None
        if not self.batching:
            log.warning("ethtool not found (Debian package ethtool): UDP GSO/GRO batching is "
                        "off in the testbed (SWITCHML_GSO=0), so that loss stays per datagram")
        self._choose_loss(link.loss_rate)
        # With XDP loss every veth end keeps GRO on; with the nftables rules it is off.
        gro_loss = 0.0 if self.loss_by == "xdp" else link.loss_rate
        self._add_ns(self.router_ns)
        _run(["ip", "netns", "exec", self.router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        ends = [(i, self.worker_ns(i), topo.worker_ip(i)) for i in range(topo.workers)]
        ends.append((topo.ps_link, self.ps_ns, topo.ps_ip))
        for i, ns, host_ip in ends:
            self._add_ns(ns)
            near, far, gateway = f"{self.prefix}s{i}", f"{self.prefix}h{i}", topo.gateway_ip(i)
            # Created inside the router namespace: nothing ever appears in the root namespace.
            _run(["ip", "-n", self.router_ns, "link", "add", near, "mtu", str(link.mtu), "type",
                  "veth", "peer", "name", far, "mtu", str(link.mtu), "netns", ns])
            _run(["ip", "-n", self.router_ns, "addr", "add", f"{gateway}/24", "dev", near])
            _run(["ip", "-n", ns, "addr", "add", f"{host_ip}/24", "dev", far])
            _run(["ip", "-n", self.router_ns, "link", "set", near, "up"])
            _run(["ip", "-n", ns, "link", "set", far, "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", gateway])
            for where, dev, host_end in ((self.router_ns, near, False), (ns, far, True)):
                if self.batching:
                    _run(["ip", "netns", "exec", where, "ethtool", "-K",
                          *ethtool_args(dev, host_end, gro_loss)])
                self._shape(where, dev)
                if self.loss_by == "xdp":  # each end drops what it receives: once per link
                    self._attach_loss(where, dev)
            if self.loss_by == "nftables":  # downlink loss: at the receiving host's input
                _run(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                     stdin=nft_host_loss_ruleset(LOSS_TABLE, link.loss_rate))
        if self.loss_by == "nftables":  # uplink loss: in the router (input, forward)
            _run(["ip", "netns", "exec", self.router_ns, "nft", "-f", "-"],
                 stdin=nft_loss_ruleset(LOSS_TABLE, link.loss_rate))
        log.info("testbed %s up: %d workers, %s, batching %s, loss by %s", self.prefix,
                 topo.workers, link, "on" if self.batching else "off (no ethtool)",
                 self.loss_by)

    def _choose_loss(self, loss_rate: float) -> None:
        """XDP loss where it loads (and ethtool keeps veths carrying single datagrams), else
        the nftables rules (with GRO off)."""
        if loss_rate <= 0:
            self.loss_by = "none"
            return
        if self.batching:
            try:
                self._loss_program = LossProgram(loss_rate)
                self.loss_by = "xdp"
                return
            except (OSError, subprocess.CalledProcessError) as exc:
                log.warning("XDP loss unavailable (%s): nftables loss rules, GRO off", exc)
        self.loss_by = "nftables"

    def _attach_loss(self, ns: str, dev: str) -> None:
        assert self._loss_program is not None
        _run(["ip", "-n", ns, *self._loss_program.attach_args(dev)])
        self._xdp_devices.append((ns, dev))

    def _shape(self, ns: str, dev: str) -> None:
        args = tbf_args(self.topology.link)
        if not args:
            return
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *args])
        shown = _run(["tc", "-n", ns, "qdisc", "show", "dev", dev])
        if "tbf" not in shown:
            raise TestbedError(f"tbf on {ns}/{dev} did not stick: {shown.strip()}")

    def teardown(self) -> None:
        """Kill the processes started here and delete the namespaces created here. Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        errors = []
        for ns in reversed(self.namespaces):
            res = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if res.returncode != 0:
                errors.append(f"{ns}: {res.stderr.strip()}")
        self.namespaces.clear()
        self._xdp_devices.clear()
        if self._loss_program is not None:
            self._loss_program.close()
            self._loss_program = None
        if errors:  # the claim stays (unlocked): the next cleanup tries again
            log.warning("testbed %s teardown: %s", self.prefix, "; ".join(errors))
        fd, self._claim_fd = self._claim_fd, None
        if fd is not None:
            if not errors:
                try:
                    os.unlink(os.path.join(CLAIMS_DIR, self.prefix))
                except FileNotFoundError:
                    pass
            os.close(fd)

    # -- running things inside ---------------------------------------------------------------

    def argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, argv: Sequence[str], timeout: float = 600.0) -> str:
        """Run a command in a namespace; return stdout; raise TestbedError on failure."""
        res = subprocess.run(self.argv(ns, argv), capture_output=True, text=True,
                             timeout=timeout)
        if res.returncode != 0:
            raise TestbedError(f"{' '.join(argv)} in {ns} failed ({res.returncode}): "
                               f"{res.stderr.strip()[-2000:]}")
        return res.stdout

    def popen(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process in a namespace; it is killed at teardown.

        switchml batches with UDP GSO/GRO in there as anywhere (every veth end is set to carry
        single datagrams, so loss is per datagram). Without ethtool the links would carry GSO
        runs whole (and hosts would merge with GRO before their loss rule), so loss would
        drop whole runs; batching is then turned off
        (``SWITCHML_GSO=0``, unless ``env`` says otherwise).
        """
        env = kwargs.pop("env", None)
        env = {**os.environ, **({} if self.batching else {"SWITCHML_GSO": "0"}), **(env or {})}
        proc = subprocess.Popen(self.argv(ns, argv), env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def qdisc(self, ns: str, dev: str) -> str:
        return _run(["tc", "-n", ns, "qdisc", "show", "dev", dev])

    def loss_counter(self) -> int:
        """Packets dropped so far by the loss rules: the router's (uplink) plus every host's
        (downlink): the XDP drops of every veth end, or the nftables counters."""
        if self.loss_by == "xdp":
            return sum(_xdp_drops(_run(["ip", "netns", "exec", ns, "ethtool", "-S", dev]))
                       for ns, dev in self._xdp_devices)
        total = 0
        for ns in self.namespaces:
            res = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet",
                                  LOSS_TABLE], capture_output=True, text=True)
            for line in res.stdout.splitlines():
                if "counter packets" in line:
                    total += int(line.split("counter packets")[1].split()[0])
        return total


def _xdp_drops(stats: str) -> int:
    """The sum of a veth's per-queue ``xdp_drops`` in ``ethtool -S`` output."""
    total = 0
    for line in stats.splitlines():
        name, _, value = line.strip().partition(":")
        if name.endswith("xdp_drops") and value.strip().isdigit():
            total += int(value)
    return total


class GeoTestbed(Testbed):
    """A live :class:`GeoTopology`: data centres of workers joined by shaped WAN links.

    Namespaces: ``<prefix>w<i>`` per worker, ``<prefix>d<j>`` per data-centre router, and the
    WAN core ``<prefix>rt`` (the base class's router). Everything else (claims, teardown,
    ``popen``, ``run``) is :class:`Testbed`'s.

    Example::

        with GeoTestbed(GeoTopology(dcs=(2, 2))) as tb:
            tb.run(tb.worker_ns(0), ["ping", "-c1", tb.topology.worker_ip(2)])
            print(tb.wan_bytes())
    """

    __test__ = False

    def __init__(self, topology: GeoTopology, prefix: str | None = None) -> None:
        super().__init__(topology, prefix)  # type: ignore[arg-type]
        self.geo = topology
        self._delay_line: subprocess.Popen[Any] | None = None

    @property
    def delay_device(self) -> str:
        """The WAN core's TUN device of the delay line (with ``wan_rtt_s`` > 0)."""
        return f"{self.prefix}dl"

    def dc_ns(self, j: int) -> str:
        return f"{self.prefix}d{j}"

    def wan_device(self, j: int) -> str:
        """Data centre ``j``'s WAN interface, in its router namespace."""
        return f"{self.prefix}x{j}"

    def _veth(self, ns_near: str, near: str, ns_far: str, far: str, mtu: int) -> None:
        _run(["ip", "-n", ns_near, "link", "add", near, "mtu", str(mtu), "type", "veth", "peer",
              "name", far, "mtu", str(mtu), "netns", ns_far])

    def _up(self, ns: str, dev: str, addr: str, link: LinkSpec) -> None:
        _run(["ip", "-n", ns, "addr", "add", addr, "dev", dev])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
        if self.batching:
            _run(["ip", "netns", "exec", ns, "ethtool", "-K", *ethtool_args(dev, False)])
        args = tbf_args(link)
        if args:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *args])
            if "tbf" not in _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]):
                raise TestbedError(f"tbf on {ns}/{dev} did not stick")

    def _build(self) -> None:
        geo = self.geo
        self.batching = shutil.which("ethtool") is not None
        core = self.router_ns
        self._add_ns(core)
        _run(["ip", "netns", "exec", core, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for j in range(len(geo.dcs)):
            dc = self.dc_ns(j)
            self._add_ns(dc)
            _run(["ip", "netns", "exec", dc, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            near, far = f"{self.prefix}y{j}", self.wan_device(j)
            self._veth(core, near, dc, far, geo.wan.mtu)
            self._up(core, near, f"{geo.wan_core_ip(j)}/24", geo.wan)
            self._up(dc, far, f"{geo.wan_router_ip(j)}/24", geo.wan)
            _run(["ip", "-n", dc, "route", "add", "default", "via", geo.wan_core_ip(j)])
            for i in geo.workers_of(j):
                ns = self.worker_ns(i)
                self._add_ns(ns)
                near, far = f"{self.prefix}s{i}", self.host_device(i)
                self._veth(dc, near, ns, far, geo.lan.mtu)
                self._up(dc, near, f"{geo.gateway_ip(i)}/24", geo.lan)
                self._up(ns, far, f"{geo.worker_ip(i)}/24", geo.lan)
                _run(["ip", "-n", ns, "route", "add", "default", "via", geo.gateway_ip(i)])
                _run(["ip", "-n", core, "route", "add", f"{geo.subnet}.{i}.0/24", "via",
                      geo.wan_router_ip(j)])
        if geo.wan_rtt_s > 0:
            self._start_delay_line()
        log.info("geo testbed %s up: data centres %s, LAN %s, WAN %s, WAN round trip +%g ms",
                 self.prefix, geo.dcs, geo.lan, geo.wan, geo.wan_rtt_s * 1000)

    def _start_delay_line(self) -> None:
        """Route every packet that reaches the WAN core from a data centre through the delay
        line (a TUN device and :mod:`switchml.testbed.delayline`), which gives it back half
        the round trip later; the kernel then forwards it by the main table. Packets coming
        back from the TUN device match no rule of their own, so each passes once."""
        core, dev, geo = self.router_ns, self.delay_device, self.geo
        _run(["ip", "-n", core, "tuntap", "add", "dev", dev, "mode", "tun"])
        # a queue for a burst at the WAN's rate (the default, 500 packets, drops first)
        _run(["ip", "-n", core, "link", "set", dev, "mtu", str(geo.wan.mtu), "txqueuelen",
              "10000", "up"])
        for key in ("all", "default", dev):
            _run(["ip", "netns", "exec", core, "sysctl", "-qw",
                  f"net.ipv4.conf.{key}.rp_filter=0"])
        _run(["ip", "-n", core, "route", "add", "default", "dev", dev, "table",
              str(DELAY_TABLE)])
        for j in range(len(geo.dcs)):
            _run(["ip", "-n", core, "rule", "add", "iif", f"{self.prefix}y{j}", "lookup",
                  str(DELAY_TABLE)])
        proc = self.popen(core, [sys.executable, "-m", "switchml.testbed.delayline", dev,
                                 repr(geo.wan_rtt_s / 2)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            proc.kill()
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise TestbedError(f"the WAN delay line did not start: {line!r} {err[-1000:]}")
        self._delay_line = proc

    def teardown(self) -> None:
        line, self._delay_line = self._delay_line, None
        if line is not None:  # stopped first, so that it prints its counters
            if line.poll() is None:
                line.terminate()
            try:
                out, _ = line.communicate(timeout=5)
                log.info("WAN delay line: %s", (out.strip().splitlines() or ["-"])[-1])
            except subprocess.TimeoutExpired:
                line.kill()
                line.communicate()
        super().teardown()

    def check_delay_line(self) -> None:
        """Raise TestbedError if the delay line died (the WAN would then carry nothing)."""
        line = self._delay_line
        if line is not None and line.poll() is not None:
            err = line.stderr.read() if line.stderr is not None else ""
            raise TestbedError(f"the WAN delay line exited ({line.returncode}): "
                               f"{err.strip()[-1000:]}")

    def delay_line_cpu_s(self) -> float:
        """CPU seconds (user and system) the delay line has used; 0 without one."""
        if self._delay_line is None:
            return 0.0
        with open(f"/proc/{self._delay_line.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def delay_line_packets(self) -> dict[str, int]:
        """The delay line's packet counters so far, from its TUN device: ``taken`` (read by
        the delay line), ``given_back`` (written back by it) and ``queue_drops`` (routed into
        the device but dropped there: its queue was full). Once traffic stops,
        ``taken - given_back`` is what the delay line itself dropped. Zeros without a delay
        line; TestbedError if it died."""
        self.check_delay_line()
        if self._delay_line is None:
            return {"taken": 0, "given_back": 0, "queue_drops": 0}
        stats = f"/sys/class/net/{self.delay_device}/statistics"
        out = _run(["ip", "netns", "exec", self.router_ns, "cat", f"{stats}/tx_packets",
                    f"{stats}/rx_packets", f"{stats}/tx_dropped"]).split()
        return dict(zip(("taken", "given_back", "queue_drops"), map(int, out)))

    def wan_bytes(self) -> int:
        """Bytes sent so far onto the WAN: the sum over data centres of their WAN interface's
        transmit counter (each byte between data centres is counted once, where it leaves its
        data centre)."""
        total = 0
        for j in range(len(self.geo.dcs)):
            out = _run(["ip", "netns", "exec", self.dc_ns(j), "cat",
                        f"/sys/class/net/{self.wan_device(j)}/statistics/tx_bytes"])
            total += int(out.strip())
        return total
