"""``switchml tls init`` (``cli/tls.py``)."""

from __future__ import annotations

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
