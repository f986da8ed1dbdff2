"""``switchml tls init`` (``cli/tls.py``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from switchml import links
from switchml.cli import main, tls


def test_init_makes_credentials_in_the_directory(record, parse, capsys):
    assert parse("tls", "init", "d").func is tls.run_init
    made = record(links, "make_credentials",
                  SimpleNamespace(ca="d/ca.pem", cert="d/peer.pem", key="d/peer.key"))
    assert main(["tls", "init", "d", "--days", "7"]) == 0
    assert made.args == ("d",) and made.kwargs == {"days": 7}
    assert ("made d/ca.pem, d/peer.pem and d/peer.key; the CA's key is in d-ca/ca.key: keep "
            "it off the peers") in capsys.readouterr().out


def test_init_needs_a_directory(parse, capsys):
    with pytest.raises(SystemExit):
        parse("tls", "init")
    assert "the following arguments are required: dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("tls")
    assert "required: SUBCOMMAND" in capsys.readouterr().err


def test_issue_makes_one_peers_certificate(record, parse, capsys):
    assert parse("tls", "issue", "d", "worker", "3").func is tls.run_issue
    made = record(links, "issue_credentials",
                  SimpleNamespace(ca=Path("d/worker-3/ca.pem"), cert=Path("d/worker-3/peer.pem"),
                                  key=Path("d/worker-3/peer.key")))
    assert main(["tls", "issue", "d", "worker", "3", "--days", "9"]) == 0
    assert made.args == ("d", "worker", 3) and made.kwargs == {"days": 9}
    assert ("made d/worker-3/peer.pem and d/worker-3/peer.key (with d/worker-3/ca.pem) for "
            "worker 3: give that directory to that peer alone (--tls-dir d/worker-3)"
            ) in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse("tls", "issue", "d", "admin", "0")
    assert "invalid choice: 'admin'" in capsys.readouterr().err


@pytest.mark.parametrize("days", ["0", "-5", "99999999", "soon"])
def test_a_validity_outside_a_hundred_years_is_refused_by_the_parser(days, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tls", "init", "--days", days, str(tmp_path / "creds")])
    assert exc.value.code == 2 and "argument --days" in capsys.readouterr().err
    assert not (tmp_path / "creds").exists()
