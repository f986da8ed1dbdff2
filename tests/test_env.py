"""switchml.env: the one reader of environment variables."""

from __future__ import annotations

import pytest

from switchml import env
from switchml.protocol.errors import ConfigError


def test_unset_variables_give_none_or_the_default(monkeypatch):
    for name in ("SWITCHML_SWITCH", "SWITCHML_SECRET", "SWITCHML_MTU", "SWITCHML_WINDOW",
                 "SWITCHML_ELEMENTS_PER_PACKET", "SWITCHML_GSO", "SWITCHML_DC",
                 "SWITCHML_DC_LEADERS",
                 "SWITCHML_PS_HOST", "SWITCHML_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert env.switch_addresses() is None and env.secret() is None and env.mtu() is None
    assert env.window() is None and env.elements_per_packet() is None
    assert env.dc_index() is None and env.dc_leaders() == [] and env.ps_host() is None
    assert env.batching() is True
    assert env.flag_default("port", 48864) == 48864


def test_set_variables_are_parsed(monkeypatch):
    monkeypatch.setenv("SWITCHML_SWITCH", "10.0.0.1:9000")
    assert env.switch_addresses() == ("10.0.0.1", 9000)
    monkeypatch.setenv("SWITCHML_SWITCH", "h:1,h:2")
    assert env.switch_addresses() == [("h", 1), ("h", 2)]
    monkeypatch.setenv("SWITCHML_SECRET", "s3cret")
    assert env.secret() == b"s3cret"
    monkeypatch.setenv("SWITCHML_MTU", "9000")
    assert env.mtu() == 9000
    for off in ("0", "off", "No", "false"):
        monkeypatch.setenv("SWITCHML_GSO", off)
        assert env.batching() is False
    monkeypatch.setenv("SWITCHML_PORT", "9100")
    assert env.flag_default("port", 48864) == "9100"


def test_bad_values_say_which_variable(monkeypatch):
    monkeypatch.setenv("SWITCHML_SWITCH", "nohostport")
    with pytest.raises(ConfigError, match="SWITCHML_SWITCH must be HOST:PORT"):
        env.switch_addresses()
    monkeypatch.setenv("SWITCHML_WINDOW", "many")
    with pytest.raises(ValueError, match="SWITCHML_WINDOW must be an integer, got 'many'"):
        env.window()


def test_only_the_edges_read_the_environment():
    """No module but env.py reads os.environ (setting it for a child process is fine)."""
    import ast
    from pathlib import Path

    import switchml
    root = Path(switchml.__file__).resolve().parent
    readers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and (node.func.attr == "getenv" or (
                        node.func.attr == "get" and ast.unparse(node.func.value).endswith(
                            "environ")))):
                readers.append(f"{path.relative_to(root)}:{node.lineno}")
            elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                  and ast.unparse(node.value) == "os.environ"):
                readers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert all(r.startswith("env.py") for r in readers), readers


def test_failover_variables(monkeypatch):
    for name in ("SWITCHML_FAILOVER", "SWITCHML_FAILOVER_PROBE_S", "SWITCHML_FAILOVER_KEEP_MB"):
        monkeypatch.delenv(name, raising=False)
    assert env.failover() == "off" and env.failover_probe_s() == 10.0
    assert env.failover_keep_bytes() is None
    monkeypatch.setenv("SWITCHML_FAILOVER", "GLOO")
    monkeypatch.setenv("SWITCHML_FAILOVER_PROBE_S", "0.5")
    monkeypatch.setenv("SWITCHML_FAILOVER_KEEP_MB", "1.5")
    assert env.failover() == "gloo" and env.failover_probe_s() == 0.5
    assert env.failover_keep_bytes() == 3 * 2**19
    for name, bad, said in (("SWITCHML_FAILOVER", "nccl", "gloo or off"),
                            ("SWITCHML_FAILOVER_PROBE_S", "-1", "seconds >= 0"),
                            ("SWITCHML_FAILOVER_PROBE_S", "nan", "seconds >= 0, got 'nan'"),
                            ("SWITCHML_FAILOVER_KEEP_MB", "lots", "MiB >= 0"),
                            ("SWITCHML_FAILOVER_KEEP_MB", "inf", "MiB >= 0, got 'inf'")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=said):
            {"SWITCHML_FAILOVER": env.failover, "SWITCHML_FAILOVER_PROBE_S":
             env.failover_probe_s, "SWITCHML_FAILOVER_KEEP_MB": env.failover_keep_bytes}[name]()


def test_the_stall_log_and_flight_signal_variables_say_what_is_wrong(monkeypatch, caplog):
    monkeypatch.delenv("SWITCHML_STALL_LOG_S", raising=False)
    assert env.stall_log_s() is None
    monkeypatch.setenv("SWITCHML_STALL_LOG_S", "2.5")
    assert env.stall_log_s() == 2.5
    for bad in ("abc", "-1", "0", "nan"):
        monkeypatch.setenv("SWITCHML_STALL_LOG_S", bad)
        with pytest.raises(ValueError, match=f"SWITCHML_STALL_LOG_S must be a number of "
                                             f"seconds .*got '{bad}'"):
            env.stall_log_s()
    # a signal that cannot be caught is a warning naming it, not an OSError from deep inside
    # (the group is built by then)
    import logging

    from switchml.torch import flight
    with caplog.at_level(logging.WARNING, logger=flight.log.name):
        flight.install_signal("KILL")
    assert "SWITCHML_FLIGHT_SIGNAL=KILL: cannot be caught" in caplog.text
