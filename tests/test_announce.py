"""The switch's listening line: the contract between ``switchml switch`` and its launchers."""

from __future__ import annotations

from switchml.control.announce import LISTENING, announce, parse_listening


class _Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def test_the_line_is_one_write_and_reads_back_its_address():
    out = _Writes()
    announce(("127.0.0.1", 48865), (1, 2), out)
    # one write: two shards sharing a pipe cannot interleave their lines (print() writes the
    # text and the newline separately when unbuffered)
    assert out.calls == [f"{LISTENING} 127.0.0.1:48865 (shard 1/2)\n"]
    assert parse_listening(out.calls[0]) == ("127.0.0.1", 48865)
    one = _Writes()
    announce(("10.0.0.1", 9), out=one)
    assert one.calls == ["switchml switch listening on udp 10.0.0.1:9\n"]
    assert parse_listening(one.calls[0]) == ("10.0.0.1", 9)


def test_other_lines_are_not_listening_lines():
    for line in ("", "\n", "switchml switch listening on tcp 1.2.3.4:5",
                 f"{LISTENING} 127.0.0.1:1{LISTENING} 127.0.0.1:2"):
        assert parse_listening(line) is None, line
