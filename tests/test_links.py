"""The TCP links' helpers (``switchml.links``): the flood guard on refusal warnings, the
loopback test behind every exposure check, and the credential files' modes."""

from __future__ import annotations

import logging
import stat

import pytest

from switchml import links
from switchml.protocol.errors import ConfigError


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_warning_budget_logs_a_burst_then_counts_the_rest(monkeypatch, caplog) -> None:
    clock = _Clock()
    monkeypatch.setattr(links.time, "monotonic", clock)
    log = logging.getLogger("test.budget")
    budget = links.WarningBudget(log, burst=3, window_s=10.0)
    with caplog.at_level(logging.WARNING, logger="test.budget"):
        for i in range(7):
            budget.warn("refused %d", i)
        assert [r.getMessage() for r in caplog.records] == [
            "refused 0", "refused 1", "refused 2"]
        clock.t += 9.9  # still the same window
        budget.warn("refused %d", 7)
        assert len(caplog.records) == 3
        clock.t += 0.2  # a new window: the count of the ones suppressed, then the new one
        budget.warn("refused %d", 8)
        assert [r.getMessage() for r in caplog.records[3:]] == [
            "... and 5 more refusals in 10 s (suppressed)", "refused 8"]


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
    ("0.0.0.0", False), ("10.0.0.1", False), ("::", False), ("example.invalid", False)])
def test_is_loopback(host, loopback) -> None:
    assert links.is_loopback(host) is loopback


def test_credentials_are_private_and_never_overwritten(tmp_path) -> None:
    pytest.importorskip("cryptography", reason="making credentials needs cryptography")
    d = tmp_path / "creds"
    links.make_credentials(d)
    kd = tmp_path / "creds-ca"  # the CA's key: never in the directory the peers load
    assert stat.S_IMODE(d.stat().st_mode) == stat.S_IMODE(kd.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
    assert modes == {"ca.pem": 0o644, "peer.pem": 0o644, "peer.key": 0o600}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in kd.iterdir()} == {"ca.key": 0o600}
    before = {p: p.read_bytes() for p in [*d.iterdir(), *kd.iterdir()]}
    with pytest.raises(ConfigError, match="already holds TLS credentials; not overwriting"):
        links.make_credentials(d)
    (d / "ca.pem").unlink()  # the CA's key alone is not overwritten either
    (d / "peer.key").unlink()
    with pytest.raises(ConfigError, match="already holds TLS credentials; not overwriting"):
        links.make_credentials(d)
    assert (kd / "ca.key").read_bytes() == before[kd / "ca.key"]


def test_a_peers_own_certificate_names_it_and_is_signed_by_the_jobs_ca(tmp_path) -> None:
    """``issue_credentials``: DIR/ROLE-ID holds the CA, a key of its own (0600) and a
    certificate that the CA signed and that names the peer (read back with cryptography);
    nothing is overwritten, and a wrong role, id or missing CA is refused with the reason."""
    x509 = pytest.importorskip("cryptography.x509", reason="making credentials needs it")
    d = tmp_path / "job"
    with pytest.raises(ConfigError, match="cannot read the CA .* switchml tls init"):
        links.issue_credentials(d, "worker", 0)
    links.make_credentials(d)
    sec = links.issue_credentials(d, "worker", 3)
    assert sec.cert == d / "worker-3" / "peer.pem"
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in sec.cert.parent.iterdir()} == {
        "ca.pem": 0o644, "peer.pem": 0o644, "peer.key": 0o600}
    assert (d / "worker-3" / "ca.pem").read_bytes() == (d / "ca.pem").read_bytes()
    cert = x509.load_pem_x509_certificate(sec.cert.read_bytes())
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["switchml:worker:3"]
    shared = x509.load_pem_x509_certificate((d / "peer.pem").read_bytes())
    with pytest.raises(x509.ExtensionNotFound):  # the shared certificate names nobody
        shared.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    with pytest.raises(ConfigError, match="already exists; not overwriting"):
        links.issue_credentials(d, "worker", 3)
    with pytest.raises(ConfigError, match="role must be one of worker, server, dc"):
        links.issue_credentials(d, "admin", 0)
    with pytest.raises(ConfigError, match="id is >= 0"):
        links.issue_credentials(d, "dc", -1)
