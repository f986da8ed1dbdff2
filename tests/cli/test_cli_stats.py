"""``switchml stats`` (``cli/stats.py``): a switch's counters, summed over shards."""

from __future__ import annotations

from switchml.cli import main, stats
from switchml.control import metrics


def _reading(packets_in: float, drops: float) -> dict:
    return {"switchml_packets_in_total": packets_in, "switchml_pool_slots": 1024.0,
            "switchml_drops_total": {"short": drops}}


def test_the_url_may_come_from_the_environment(monkeypatch, parse):
    assert parse("stats").url == "http://127.0.0.1:9109/metrics"
    monkeypatch.setenv("SWITCHML_STATS_URL", "http://h:1/metrics")
    args = parse("stats", "--interval-s", "2")
    assert (args.url, args.interval_s, args.once, args.func) == ("http://h:1/metrics", 2.0,
                                                                 False, stats.run)


def test_once_prints_the_shards_summed(monkeypatch, capsys):
    readings = {"http://a/m": _reading(10, 1), "http://b/m": _reading(5, 2)}
    asked: list[str] = []

    def read_metrics(url: str) -> dict:
        asked.append(url)
        return readings[url]

    monkeypatch.setattr(metrics, "read_metrics", read_metrics)
    assert main(["stats", "--once", "--url", "http://a/m,http://b/m"]) == 0
    out = capsys.readouterr().out
    assert asked == ["http://a/m", "http://b/m"]
    assert "packets in" in out and "15" in out and "drops: short" in out
    assert "0 / 2048" in out  # slots in use / pool slots, summed


def test_an_unreachable_switch_is_an_error(record, capsys):
    record(metrics, "read_metrics", OSError("connection refused"))
    assert main(["stats", "--once", "--url", "http://x/m"]) == 2
    err = capsys.readouterr().err
    assert "can't read http://x/m: connection refused (is a switch running" in err


def test_rates_need_an_earlier_reading():
    now, before = _reading(30, 4), _reading(10, 1)
    assert stats._counter_rate(now, None, 1.0, "switchml_packets_in_total") == ""
    assert stats._counter_rate(now, before, 2.0, "switchml_packets_in_total") == "10"
    assert stats._counter_rate(now, before, 0.5, "switchml_drops_total", "short") == "6"
