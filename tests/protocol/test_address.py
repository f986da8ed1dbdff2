"""Addresses (``protocol/address.py``): one switch or a sharded switch's shards, told apart once."""

from __future__ import annotations

import pytest

from switchml.protocol.address import (
    as_addresses,
    format_addresses,
    parse_address,
    parse_addresses,
)
from switchml.protocol.errors import ConfigError


def test_one_address_or_shards_become_a_tuple_of_addresses():
    assert as_addresses(("h", 1)) == (("h", 1),)
    assert as_addresses([("h", 1), ("h", 2)]) == (("h", 1), ("h", 2))
    assert as_addresses((("h", 1),)) == (("h", 1),)
    assert as_addresses(as_addresses(("h", 1))) == (("h", 1),)  # idempotent
    with pytest.raises(ConfigError, match="empty list"):
        as_addresses([])


def test_formatting_and_parsing_round_trip():
    assert format_addresses(as_addresses(("h", 1))) == "h:1"
    assert format_addresses(parse_addresses("h:1,h:2")) == "shards h:1, h:2"
    assert parse_address(" h:48864 ") == ("h", 48864)
    with pytest.raises(ConfigError, match="SWITCHML_SWITCH"):
        parse_addresses("h", what="SWITCHML_SWITCH")
