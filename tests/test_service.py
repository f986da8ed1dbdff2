"""``switchml.service``: the one place switches are launched (single, sharded, rack, child)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from switchml import service
from switchml.control.announce import parse_listening
from switchml.protocol.errors import TransportError
from switchml.service import SwitchSpec


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch):
    monkeypatch.delenv("SWITCHML_SECRET", raising=False)


def test_a_shard_runs_the_same_switch_on_its_own_port():
    spec = SwitchSpec(port=9000, pool_slots=64, lease_timeout_s=5.0, nack_gap=2,
                      stats_interval_s=1.0, member_timeout_s=3.0, metrics_port=9109,
                      log_level="warning", quorum_history=5)
    assert service.shard_argv(spec, 1, 3) == [
        sys.executable, "-m", "switchml", "--log-level", "warning", "switch",
        "--host", "127.0.0.1", "--port", "9001", "--shard", "1/3", "--pool-slots", "64",
        "--lease-timeout-s", "5.0", "--nack-gap", "2", "--stats-interval-s", "1.0",
        "--member-timeout-s", "3.0", "--challenges-per-s", "4096.0", "--quorum-history", "5",
        "--metrics-port", "9110",
        "--stop-on-stdin-eof"]
    tail = service.shard_argv(SwitchSpec(metrics_port=0, secret_file="/s", insecure=True,
                                         mtu=9000, batching=False, tenant_slots=32), 0, 2)
    assert tail[tail.index("--metrics-port") + 1] == "0"
    assert tail[-8:] == ["--tenant-slots", "32", "--secret-file", "/s", "--insecure", "--mtu",
                         "9000", "--no-batching"]
    assert service._switch_config(SwitchSpec(tenant_slots=32), None).tenant_slots == 32
    assert service._switch_config(SwitchSpec(challenges_per_s=0), None).challenges_per_s \
        is None  # 0: no budget, in process as on the command line


def test_shard_count():
    assert service.shard_count(SwitchSpec()) == 1
    assert service.shard_count(SwitchSpec(shards=0)) == (os.cpu_count() or 1)
    assert service.shard_count(SwitchSpec(shards=3, shard=None)) == 3
    assert service.shard_count(SwitchSpec(shard=(0, 2))) == 1
    with pytest.raises(ValueError, match="SwitchSpec.shards must be >= 0"):
        service.shard_count(SwitchSpec(shards=-2))
    with pytest.raises(ValueError, match="not both"):
        service.shard_count(SwitchSpec(shards=2, shard=(0, 2)))


def test_the_secret_comes_from_the_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(b"s" * 32 + b"\n")
    assert service.switch_secret(SwitchSpec(secret_file=str(path))) == b"s" * 32
    assert service.switch_secret(SwitchSpec()) is None  # loopback needs none
    with pytest.raises(ValueError, match="exposes job creation to the network"):
        service.switch_secret(SwitchSpec(host="192.0.2.1"))
    assert service.switch_secret(SwitchSpec(host="192.0.2.1", insecure=True)) is None
    monkeypatch.setenv("SWITCHML_SECRET", "e" * 20)
    assert service.switch_secret(SwitchSpec(host="192.0.2.1")) == b"e" * 20


def test_the_server_is_configured_by_the_spec():
    from switchml.protocol.wire import elements_for_mtu
    server = service.build_server(SwitchSpec(port=0, pool_slots=32, lease_timeout_s=7.0,
                                             nack_gap=1, member_timeout_s=2.0, mtu=1500,
                                             shard=(1, 2)), b"k" * 16)
    try:
        cfg = server.dataplane.config
        assert (cfg.pool_slots, cfg.lease_timeout_s, cfg.nack_gap, cfg.member_timeout_s,
                cfg.secret, cfg.shard_index, cfg.shard_count) == (32, 7.0, 1, 2.0, b"k" * 16,
                                                                   1, 2)
        assert cfg.max_elements_per_packet == elements_for_mtu(1500)
        assert server.address[0] == "127.0.0.1" and server.address[1] > 0
    finally:
        server.stop()


def test_serve_announces_its_address_and_stops_when_told(capsys):
    stop = threading.Event()
    status: list[int] = []
    t = threading.Thread(target=lambda: status.append(service.serve(
        SwitchSpec(port=0, metrics_port=0), stop)))
    t.start()
    deadline = time.monotonic() + 20
    out = ""
    while parse_listening(out) is None and time.monotonic() < deadline:
        time.sleep(0.05)
        out += capsys.readouterr().out
    stop.set()
    t.join(10)
    assert parse_listening(out) is not None, out
    assert status == [0] and not t.is_alive()


def test_serve_refuses_shards_without_a_fixed_port():
    with pytest.raises(ValueError, match=r"SwitchSpec.shards needs a fixed SwitchSpec.port"):
        service.serve(SwitchSpec(port=0, shards=2), threading.Event())


def test_a_child_switch_says_where_it_listens_and_stops_on_stdin_eof():
    child = service.start_switch_process(
        ["switch", "--port", "0", "--metrics-port", "0", "--stop-on-stdin-eof"],
        environ=os.environ, start_timeout_s=30)
    try:
        assert child.address[0] == "127.0.0.1" and child.address[1] > 0
        assert child.proc.poll() is None
    finally:
        service.stop_switch_process(child.proc)
    assert child.proc.returncode == 0


def test_a_child_switch_that_fails_says_why():
    with pytest.raises(TransportError, match=r"exited with status 2.*exposes job creation"):
        service.start_switch_process(["switch", "--host", "192.0.2.1", "--port", "0"],
                                     environ={k: v for k, v in os.environ.items()
                                              if k != "SWITCHML_SECRET"},
                                     start_timeout_s=30)


def test_the_service_sits_below_its_users():
    """Imports point down: the launchers' users (command, torch backend, benchmarks) import the
    service, never the other way round."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(service.__file__).read_text(encoding="utf-8"))
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    upward = {m for m in names
              if m.split(".")[:2] in (["switchml", "cli"], ["switchml", "torch"],
                                      ["switchml", "bench"])}
    assert "switchml.transport.udp" in names and upward == set()
