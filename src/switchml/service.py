"""Launch software switches: one, a sharded one, a rack switch, or one in a child process.

Every way this package starts a switch goes through here:

- ``switchml switch`` (:mod:`switchml.cli.switch`) turns its flags into a :class:`SwitchSpec`
  and calls :func:`serve`: one switch, a rack switch (``upstream``) or, for ``shards`` > 1, a
  supervisor of S ``switchml switch --shard i/S`` processes (:func:`shard_argv`);
- the PyTorch backend's embedded switch is ``switchml switch`` in a child process, started by
  :func:`start_switch_process`, which waits for the child's listening line
  (:mod:`switchml.control.announce`: a structured line, parsed, never matched as free text);
- the benchmarks' :class:`switchml.bench.switchproc.SwitchProcess`, and the testbed's switches
  and rack switches (:mod:`switchml.bench.nsproc`, which announce themselves with the
  command's listening line), build their servers with :func:`build_server`.

A switch in the foreground serves until its stop event is set: by SIGINT/SIGTERM (the
command's handlers), by a shard that died (the supervisor), or, with ``stop_on_stdin_eof``, once
standard input has closed and the switch has been quiet for a moment (the embedded switch dies
with the process that started it).
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from switchml import env
from switchml.protocol.address import Address

if TYPE_CHECKING:
    from switchml.protocol.tree import RackAggregator
    from switchml.transport.udp import SwitchServer

__all__ = ["SwitchChild", "SwitchSpec", "build_server", "rack_aggregator", "serve",
           "shard_argv", "shard_count", "start_switch_process",
           "stop_switch_process", "switch_secret"]

log = logging.getLogger("switchml")

SIGNAL_POLL_S = 0.5
"""How often a foreground wait wakes: a signal delivered to another thread only runs its
Python handler when the main thread executes bytecode, which a bare ``wait()`` never does."""

_OWNER_GONE_QUIET_S = 1.0
_OWNER_GONE_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class SwitchSpec:
    """What to run: the options of ``switchml switch``, by field (defaults are the command's).

    ``batching`` is the final word (the command folds ``SWITCHML_GSO`` into it); ``secret_file``
    unset means ``SWITCHML_SECRET`` (or no secret). ``shards`` > 1 runs that many processes on
    ports ``port`` .. ``port + shards - 1``; ``shard`` = (i, S) runs shard i of S alone;
    ``upstream``, ``rack`` and ``job`` make a rack switch of a hierarchical job.
    """

    host: str = "127.0.0.1"
    port: int = 48864
    pool_slots: int = 1024
    stats_interval_s: float = 0.0
    lease_timeout_s: float = 30.0
    member_timeout_s: float = 20.0
    challenges_per_s: float | None = 4096.0
    nack_gap: int = 4
    quorum_history: int = 16
    tenant_slots: int | None = None
    secret_file: str | None = None
    insecure: bool = False
    metrics_port: int = 9109
    mtu: int | None = None
    batching: bool = True
    stop_on_stdin_eof: bool = False
    shards: int = 1
    shard: tuple[int, int] | None = None
    upstream: Address | None = None
    rack: tuple[int, int] | None = None
    job: str | None = None
    log_level: str = "info"
    """The log level of the shards' processes (``shards`` > 1)."""


# -- one switch --------------------------------------------------------------------------------


def switch_secret(spec: SwitchSpec) -> bytes | None:
    """The job-creation secret (``secret_file`` or ``SWITCHML_SECRET``).

    Raises:
        ValueError: there is none and ``spec.host`` is not loopback, unless ``insecure``.
    """
    secret = None
    if spec.secret_file:
        try:
            with open(spec.secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"can't read SwitchSpec.secret_file {spec.secret_file}: "
                             f"{exc.strerror or exc}") from None
    else:
        secret = env.secret()
    from switchml.transport.sockets import resolves_to_loopback
    if secret is None and not resolves_to_loopback(spec.host) and not spec.insecure:
        raise ValueError(f"listening on {spec.host} exposes job creation to the network: give "
                         "SwitchSpec.secret_file (or SWITCHML_SECRET), or SwitchSpec.insecure to "
                         "allow it anyway")
    return secret


SHARDS_PER_CORE = 4
"""The most switch processes ``shards`` may run per core of this machine."""


def shard_count(spec: SwitchSpec) -> int:
    """How many switch processes ``spec.shards`` asks for here (0: one per core).

    Raises:
        ValueError: ``shards`` < 0 or more than ``SHARDS_PER_CORE`` per core (each is a
            process), ports ``port`` .. ``port + shards - 1`` or their metrics ports past
            65535, or both ``shards`` > 1 and ``shard`` given.
    """
    cores = os.cpu_count() or 1
    shards = spec.shards if spec.shards > 0 else cores
    if spec.shards < 0:
        raise ValueError(f"SwitchSpec.shards must be >= 0, got {spec.shards}")
    if shards > SHARDS_PER_CORE * cores:
        raise ValueError(f"SwitchSpec.shards {shards} is more than {SHARDS_PER_CORE} per core "
                         f"of this machine's {cores} (each shard is a process of its own): "
                         "run shards on more hosts (SwitchSpec.shard I/S on each)")
    for what, port in (("port", spec.port), ("metrics_port", spec.metrics_port)):
        if port and port + shards - 1 > 65535:
            raise ValueError(f"SwitchSpec.{what} {port} + {shards} shards passes 65535 (shard "
                             "i listens on port + i)")
    if shards > 1 and spec.shard is not None:
        raise ValueError("give SwitchSpec.shards (run them all here) or SwitchSpec.shard I/S "
                         "(one), "
                         "not both")
    return shards


def _switch_config(spec: SwitchSpec, secret: bytes | None, **extra: Any) -> Any:
    """The data plane's :class:`SwitchConfig` of ``spec``."""
    from switchml.protocol.config import SwitchConfig
    return SwitchConfig(pool_slots=spec.pool_slots, lease_timeout_s=spec.lease_timeout_s,
                        secret=secret, nack_gap=spec.nack_gap,
                        member_timeout_s=spec.member_timeout_s,
                        challenges_per_s=spec.challenges_per_s or None,  # (0: none)
                        quorum_history=spec.quorum_history,
                        tenant_slots=spec.tenant_slots, **extra)


def rack_aggregator(spec: SwitchSpec, secret: bytes | None) -> RackAggregator:
    """The rack data plane of ``spec.upstream``; prints the job spec its own workers join with.

    Raises:
        ValueError: ``rack`` or ``job`` is missing.
    """
    from switchml.control import decode_job_spec, encode_job_spec
    from switchml.protocol.tree import RackAggregator, TreeConfig, tree_specs
    from switchml.transport.sockets import resolve_ipv4
    if spec.rack is None or spec.job is None or spec.upstream is None:
        raise ValueError("SwitchSpec.upstream needs SwitchSpec.rack I/R and SwitchSpec.job SPEC")
    parent, child = tree_specs(decode_job_spec(spec.job), spec.rack[1])
    rack = RackAggregator(parent_spec=parent, child_spec=child, rack=spec.rack[0],
                          parent_address=(resolve_ipv4(spec.upstream[0], "upstream"),
                                          spec.upstream[1]),
                          config=TreeConfig(secret=secret),
                          switch_config=_switch_config(spec, secret))
    print(f"rack {spec.rack[0]} of {spec.rack[1]}: its workers join with "
          f"SWITCHML_JOB={encode_job_spec(child)} (rank = global rank mod "
          f"{child.num_workers})", flush=True)
    return rack


def build_server(spec: SwitchSpec, secret: bytes | None,
                 rack: RackAggregator | None = None) -> SwitchServer:
    """The (not yet started) UDP switch server ``spec`` describes (its ``shard``, if any)."""
    from switchml.protocol.wire import elements_for_mtu
    from switchml.transport.udp import SwitchServer

    shard_index, shards = spec.shard or (0, 1)
    extra: dict[str, Any] = {"shard_index": shard_index, "shard_count": shards}
    if spec.mtu:
        extra["max_elements_per_packet"] = elements_for_mtu(spec.mtu)
    return SwitchServer(host=spec.host, port=spec.port,
                        config=_switch_config(spec, secret, **extra),
                        batching=spec.batching, dataplane=rack, insecure=spec.insecure)


def _start_metrics(server: SwitchServer, pool_slots: int, port: int) -> None:
    """Serve ``server``'s counters on http://127.0.0.1:PORT/metrics (a warning if it can't)."""
    from switchml.control.metrics import start_exporter
    try:
        start_exporter(server.stats, pool_slots, "127.0.0.1", port)
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
    except OSError as exc:
        log.warning("metrics endpoint not started on port %d: %s", port, exc)


def serve(spec: SwitchSpec, stop: threading.Event) -> int:
    """Run the switch ``spec`` describes until ``stop`` is set: one switch, a rack switch
    (``upstream``) or, with ``shards`` > 1, a supervisor of that many switch processes.

    1. Read the secret (refusing an exposed switch without one) and count the shards.
    2. One switch: build the rack data plane (it prints its workers' job spec), start the
       server and its metrics; a rack switch joins its parent's job.
    3. Announce the address (:func:`switchml.control.announce.announce`: the launchers'
       contract), then wait for ``stop`` (or standard input's end, if asked).

    Returns:
        0 once stopped; 1 when a shard died.
    Raises:
        ValueError: a bad secret set-up, shard or rack options; OSError: the port is in use.
    """
    secret = switch_secret(spec)
    shards = shard_count(spec)
    if shards > 1:
        return _serve_shards(spec, shards, stop)
    from switchml.control.announce import announce

    rack = rack_aggregator(spec, secret) if spec.upstream is not None else None
    server = build_server(spec, secret, rack)
    if spec.metrics_port:
        _start_metrics(server, spec.pool_slots, spec.metrics_port)
    server.start()
    if rack is not None:
        server.run_command(rack.join)  # join the parent job upstream
    announce(server.address, spec.shard or (0, 1))
    if spec.stop_on_stdin_eof:
        _stop_on_stdin_eof(stop, server)
    _serve_until_stopped(server, stop, spec.stats_interval_s)
    server.stop()
    return 0


def _stop_on_stdin_eof(stop: threading.Event, server: SwitchServer) -> None:
    """Set ``stop`` once standard input has closed (the owner is gone) and the switch has
    then been quiet for ``_OWNER_GONE_QUIET_S`` (at most ``_OWNER_GONE_MAX_S``).

    Not at once: the owner's process (rank 0 of an embedded switch) may end first in an
    operation whose outcome the other ranks have yet to hear, a MISMATCH, say. A switch
    that stopped with it left them waiting out their timeout; it answers them first."""
    def _watch_stdin() -> None:
        while sys.stdin.read(4096):
            pass
        log.info("standard input closed: stopping once quiet for %g s", _OWNER_GONE_QUIET_S)
        deadline = time.monotonic() + _OWNER_GONE_MAX_S
        seen = server.stats().get("packets_in")
        while not stop.wait(_OWNER_GONE_QUIET_S) and time.monotonic() < deadline:
            now = server.stats().get("packets_in")
            if now == seen:
                break
            seen = now
        stop.set()
    threading.Thread(target=_watch_stdin, daemon=True).start()


def _serve_until_stopped(server: SwitchServer, stop: threading.Event,
                         stats_interval_s: float) -> None:
    """Wait for ``stop``, logging the counters every ``stats_interval_s`` (if > 0)."""
    next_stats = time.monotonic() + stats_interval_s if stats_interval_s > 0 else None
    while not stop.wait(SIGNAL_POLL_S):
        if next_stats is not None and time.monotonic() >= next_stats:
            log.info("stats: %s", server.stats())
            next_stats += stats_interval_s


# -- a sharded switch --------------------------------------------------------------------------


def shard_argv(spec: SwitchSpec, i: int, shards: int) -> list[str]:
    """The command line of shard ``i`` of ``shards`` (``switchml switch --shards``)."""
    argv = [sys.executable, "-m", "switchml", "--log-level", spec.log_level, "switch",
            "--host", spec.host, "--port", str(spec.port + i), "--shard", f"{i}/{shards}",
            "--pool-slots", str(spec.pool_slots), "--lease-timeout-s", str(spec.lease_timeout_s),
            "--nack-gap", str(spec.nack_gap), "--stats-interval-s", str(spec.stats_interval_s),
            "--member-timeout-s", str(spec.member_timeout_s),
            "--challenges-per-s", str(spec.challenges_per_s or 0),
            "--quorum-history", str(spec.quorum_history),
            "--metrics-port", str(spec.metrics_port + i if spec.metrics_port else 0),
            "--stop-on-stdin-eof"]
    if spec.tenant_slots is not None:
        argv += ["--tenant-slots", str(spec.tenant_slots)]
    if spec.secret_file:
        argv += ["--secret-file", spec.secret_file]
    if spec.insecure:
        argv.append("--insecure")
    if spec.mtu:
        argv += ["--mtu", str(spec.mtu)]
    if not spec.batching:
        argv.append("--no-batching")
    return argv


def _serve_shards(spec: SwitchSpec, shards: int, stop: threading.Event) -> int:
    """Run ``shards`` switch processes and watch them until ``stop``: a shard that dies stops
    the others and the call fails naming it (its workers fail within their timeout, naming it
    too).

    Raises:
        ValueError: ``spec.port`` is 0 (shard i listens on port + i).
    """
    if spec.port == 0:
        raise ValueError("SwitchSpec.shards needs a fixed SwitchSpec.port (shard i listens on "
                         "PORT+i)")
    addrs = ",".join(f"{spec.host}:{spec.port + i}" for i in range(shards))
    # Said before the shards start, so that it is the first line (the shards print theirs).
    print(f"switchml switch: {shards} shards on udp {addrs} (workers: SWITCHML_SWITCH={addrs})",
          flush=True)
    procs = [subprocess.Popen(shard_argv(spec, i, shards), stdin=subprocess.PIPE)
             for i in range(shards)]
    failed = None
    while not stop.wait(SIGNAL_POLL_S):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                failed = (i, p.returncode)
                stop.set()
                break
    for p in procs:
        if p.poll() is None:
            p.stdin.close()  # type: ignore[union-attr]  # --stop-on-stdin-eof
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    if failed is not None:
        i, rc = failed
        log.error("shard %d (udp %s:%d) exited with status %s; stopped the others", i,
                  spec.host, spec.port + i, rc)
        return 1
    return 0


# -- a switch in a child process ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwitchChild:
    """A ``switchml switch`` child process and the address it announced."""

    proc: subprocess.Popen[str]
    address: Address


def start_switch_process(args: Sequence[str], *, environ: Mapping[str, str],
                         start_timeout_s: float) -> SwitchChild:
    """Start ``python -m switchml ARGS`` (a ``switch`` command line) and wait for its listening
    line (:func:`switchml.control.announce.parse_listening`).

    The child's standard input stays open (with ``--stop-on-stdin-eof`` it stops once the pipe
    closes: :func:`stop_switch_process`); its standard error goes on to this process's, line by
    line, from a daemon thread.

    Raises:
        TransportError: no listening line within ``start_timeout_s``, naming what the child
        said instead and its last words on standard error.
    """
    from switchml.control.announce import parse_listening
    from switchml.protocol.errors import TransportError

    proc = subprocess.Popen(
        [sys.executable, "-m", "switchml", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(environ))
    assert proc.stdout is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], start_timeout_s)
    line = proc.stdout.readline() if ready else ""
    address = parse_listening(line)
    if address is None:
        proc.kill()
        _, err = proc.communicate()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        said = (f"exited with status {proc.returncode}" if ready and not line
                else f"said {line!r}" if ready
                else f"said nothing in {start_timeout_s:g} s")
        tail = " | ".join(err.strip().splitlines()[-5:])
        raise TransportError(f"the embedded switch did not start ({said})"
                             + (f"; its last words: {tail}" if tail else ""))
    threading.Thread(target=_forward, args=(proc.stderr,), daemon=True,
                     name="switchml-switch-log").start()
    return SwitchChild(proc=proc, address=address)


def stop_switch_process(proc: subprocess.Popen[str] | None, timeout_s: float = 8.0) -> None:
    """Close the child's standard input (it exits once quiet, at most 5 s) and wait for it;
    kill it if it has not exited within ``timeout_s``."""
    if proc is None:
        return
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def _forward(pipe: IO[str]) -> None:
    """Copy a child switch's standard error to ours, line by line, until it closes."""
    try:
        for line in pipe:
            sys.stderr.write(line)
    except (OSError, ValueError):
        pass
