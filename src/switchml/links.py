"""Authenticated, encrypted TCP links for the parameter servers and Gaia's data centres.

Both speak the framed protocol of ``ps/wire.py`` over TCP. With credentials, every link is
mutual TLS 1.3 (Python's ``ssl``): each side proves it holds a certificate signed by the
cluster's CA, and every byte is encrypted and integrity-protected, so a stranger can neither
connect, nor read, nor alter what travels (Gaia's links cross data centres, that is, networks
nobody here controls). Without credentials a link is plain TCP, allowed on loopback only
(:func:`check_exposure`).

Credentials are a directory (``SWITCHML_TLS_DIR``, or ``--tls-dir``) with three PEM files:
``ca.pem`` (the cluster's CA certificate), ``peer.pem`` and ``peer.key`` (this peer's
certificate, signed by that CA, and its key). ``switchml tls init DIR`` makes a CA and one peer
certificate that every process of a job shares (:func:`make_credentials`, with the
``cryptography`` package); ``switchml tls issue DIR ROLE ID`` makes one peer's own
(:func:`issue_credentials`), which names its identity (``URI:switchml:worker:3``), and the
other side of a link refuses a peer whose certificate names another identity than the id it
claims (:func:`identity_conflict`): a parameter server checks its workers' ids, a worker its
shard's, a Gaia leader the other data centres'. Certificates signed by the same CA with any
tool work the same. The CA's key is not needed at run time: keep it away from the peers.

What TLS does not cover: peers that hold a certificate are trusted members of the job (with
the shared certificate, one can claim another's worker id, as a member of a switchml job can
send wrong gradients; with certificates of their own, only their own id).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchml.protocol.errors import ConfigError

__all__ = ["IDENTITY_ROLES", "LinkSecurity", "WarningBudget", "ca_key_dir", "check_exposure",
           "dial", "identity_conflict", "is_loopback", "issue_credentials", "make_credentials",
           "peer_identity", "shutdown_descriptor"]

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "peer.pem", "peer.key"
CA_KEY_FILE = "ca.key"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class LinkSecurity:
    """Mutual-TLS credentials (module docstring). ``handshake_timeout_s`` bounds how long a
    peer that connects may take to prove itself before the server drops it."""

    ca: Path
    cert: Path
    key: Path
    handshake_timeout_s: float = 10.0

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> LinkSecurity:
        """The credentials in ``directory``; raises ConfigError naming a missing file."""
        d = Path(directory)
        files = [d / CA_FILE, d / CERT_FILE, d / KEY_FILE]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"TLS credentials incomplete: {', '.join(missing)} missing "
                              f"(make them with: switchml tls init {d})")
        sec = cls(*files)
        sec.server_context()  # fail now, with the reason, not at the first connection
        return sec

    def _context(self, purpose: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=str(self.ca))
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS credentials ({self.cert}, {self.key}, CA "
                              f"{self.ca}): {exc}") from exc
        return ctx

    def server_context(self) -> ssl.SSLContext:
        ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
        # No TLS 1.3 session tickets: nothing resumes sessions here, and a ticket the client
        # never reads (a Gaia sender only writes) makes its close() a reset, which can
        # destroy its last messages (the goodbye) before the server has read them.
        ctx.num_tickets = 0
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        # Peers are addressed by IP and share the cluster's CA: the CA's signature is the
        # identity, not a host name.
        ctx.check_hostname = False
        return ctx

    def accept(self, conn: socket.socket, ctx: ssl.SSLContext,
               timeout_s: float | None = None) -> ssl.SSLSocket:
        """Run the server side of the handshake on an accepted connection, bounded by
        ``handshake_timeout_s`` (or ``timeout_s``, if shorter). Raises ssl.SSLError or OSError
        (a stranger, or a peer without the cluster's certificate)."""
        conn.settimeout(min(self.handshake_timeout_s, timeout_s or self.handshake_timeout_s))
        tls = ctx.wrap_socket(conn, server_side=True)
        tls.settimeout(None)
        return tls

    def connect(self, sock: socket.socket, ctx: ssl.SSLContext) -> ssl.SSLSocket:
        """Run the client side of the handshake on a connected socket (its timeout holds)."""
        return ctx.wrap_socket(sock, server_side=False)


class WarningBudget:
    """Log refusals of hostile peers without letting them flood the log: at most ``burst``
    warnings per ``window_s``, then one line counting the ones suppressed."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, window_s: float = 10.0
                 ) -> None:
        self._log, self._burst, self._window_s = logger, burst, window_s
        self._lock = threading.Lock()
        self._start, self._logged, self._suppressed = 0.0, 0, 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start >= self._window_s:
                if self._suppressed:
                    self._log.warning("... and %d more refusals in %.0f s (suppressed)",
                                      self._suppressed, self._window_s)
                self._start, self._logged, self._suppressed = now, 0, 0
            if self._logged >= self._burst:
                self._suppressed += 1
                return
            self._logged += 1
        self._log.warning(msg, *args)


def check_exposure(host: str, security: LinkSecurity | None, *, insecure: bool = False,
                   what: str = "this server") -> None:
    """Refuse to listen beyond loopback without credentials.

    Raises:
        ConfigError: ``host`` is not loopback, there are no credentials, and not ``insecure``.
    """
    if security is None and not insecure and not is_loopback(host):
        raise ConfigError(
            f"{what} would listen on {host} without TLS: anyone who can reach it could join, "
            "read and alter its traffic. Give credentials (SWITCHML_TLS_DIR or --tls-dir; "
            "switchml tls init DIR makes them), listen on 127.0.0.1, or pass --insecure")


def ca_key_dir(directory: str | os.PathLike[str]) -> Path:
    """Where :func:`make_credentials` keeps the CA's private key for the peers' ``directory``:
    a directory of its own beside it (``DIR-ca``), never one that peers load."""
    d = Path(directory)
    return d.parent / f"{d.name}-ca"


def make_credentials(directory: str | os.PathLike[str], *, days: int = 365,
                     name: str = "switchml") -> LinkSecurity:
    """Make a CA and one peer certificate signed by it: ``ca.pem``, ``peer.pem`` and
    ``peer.key`` in ``directory``, what every process of the job loads, and the CA's key,
    ``ca.key``, in a directory of its own beside it (:func:`ca_key_dir`; both created mode
    0700, keys 0600). The shared certificate names no identity: any holder may claim any
    worker or data-centre id; :func:`issue_credentials` makes certificates that bind one.
    Needs the ``cryptography`` package.

    Raises:
        ConfigError: either directory already holds credentials, or ``cryptography`` is
            missing.
    """
    x509, hashes, _serialization, ec, NameOID = _crypto()
    d = Path(directory)
    kd = ca_key_dir(d)
    if (d / CA_FILE).exists() or (d / KEY_FILE).exists() or (kd / CA_KEY_FILE).exists():
        raise ConfigError(f"{d} (or {kd}) already holds TLS credentials; not overwriting them")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    kd.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (_certificate(ca_name, ca_name, ca_key.public_key(), now=now, days=days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False),
                         critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write_new(kd / CA_KEY_FILE, _private_pem(ca_key), 0o600)
    _write_peer(d, ca, ca_key, days=days, common_name=f"{name} peer", identity=None)
    return LinkSecurity.from_dir(d)


IDENTITY_ROLES = ("worker", "server", "dc")
"""What a certificate from :func:`issue_credentials` may name: a parameter-server worker, a
parameter-server shard, or a Gaia data centre (its leader)."""
_URI_PREFIX = "switchml:"


def issue_credentials(directory: str | os.PathLike[str], role: str, index: int, *,
                      days: int = 365) -> LinkSecurity:
    """Issue one peer's own certificate, signed by the CA that :func:`make_credentials` made
    for ``directory``: ``ca.pem``, ``peer.pem`` and ``peer.key`` in ``directory/ROLE-INDEX``
    (mode 0700; the key 0600), which that peer alone loads. The certificate names its
    identity (subject alternative name ``URI:switchml:ROLE:INDEX``), and the other side of
    every link checks it against the id the peer claims (:func:`identity_conflict`): a
    worker cannot say HELLO as another worker, nor a data centre as another.

    Raises:
        ConfigError: a role outside :data:`IDENTITY_ROLES`, a negative index, the CA's key
            not in :func:`ca_key_dir` (``ca.key``), or that peer's directory already made.
    """
    if role not in IDENTITY_ROLES:
        raise ConfigError(f"role must be one of {', '.join(IDENTITY_ROLES)}, got {role!r}")
    if index < 0:
        raise ConfigError(f"a {role} id is >= 0, got {index}")
    x509, _hashes, serialization, _ec, _name = _crypto()
    d = Path(directory)
    key_file = ca_key_dir(d) / CA_KEY_FILE
    try:
        ca = x509.load_pem_x509_certificate((d / CA_FILE).read_bytes())
        ca_key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the CA ({d / CA_FILE}, {key_file}) to sign with: "
                          f"{exc} (make it with: switchml tls init {d})") from exc
    out = d / f"{role}-{index}"
    if out.exists():
        raise ConfigError(f"{out} already exists; not overwriting its credentials")
    out.mkdir(mode=0o700)
    _write_new(out / CA_FILE, (d / CA_FILE).read_bytes(), 0o644)
    _write_peer(out, ca, ca_key, days=days, common_name=f"switchml {role} {index}",
                identity=(role, index))
    return LinkSecurity.from_dir(out)


def peer_identity(conn: socket.socket) -> tuple[str, int] | None:
    """The identity (role, id) that the certificate of a TLS link's other side names, or None
    (plain TCP, or a certificate that names none, as :func:`make_credentials`' shared one)."""
    if not isinstance(conn, ssl.SSLSocket):
        return None
    cert = conn.getpeercert() or {}
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "URI" and value.startswith(_URI_PREFIX):
            role, _, index = value[len(_URI_PREFIX):].partition(":")
            if role in IDENTITY_ROLES and index.isdigit():
                return role, int(index)
    return None


def identity_conflict(conn: socket.socket, role: str, index: int) -> str | None:
    """Why the other side of ``conn`` may not be ``role`` ``index`` (its certificate names
    another identity), or None: it names this one, or none at all."""
    named = peer_identity(conn)
    if named is None or named == (role, index):
        return None
    return (f"its certificate names {named[0]} {named[1]}, not {role} {index}: each peer "
            "must use its own (switchml tls issue)")


def dial(addr: tuple[str, int], *, what: str, connect_timeout_s: float, io_timeout_s: float,
         retry_s: float, security: LinkSecurity | None, ctx: ssl.SSLContext | None,
         role: str, index: int, claims: str, error: type[Exception]) -> socket.socket:
    """A link to peer ``role`` ``index`` (``what``, for messages) at ``addr``: connect, retrying
    every ``retry_s`` until ``connect_timeout_s`` (it may still be starting); then TCP_NODELAY,
    ``io_timeout_s`` for every later read and write and, with ``security`` and ``ctx``, TLS and
    the check that the peer's certificate names that identity (``claims`` says what it would
    not be, e.g. "shard 0"). Each failure raises ``error`` naming the peer."""
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            sock = socket.create_connection(addr, timeout=max(0.1, min(5.0, connect_timeout_s)))
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise error(f"cannot reach {what} within {connect_timeout_s:g} s: {exc}") from exc
            time.sleep(retry_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(io_timeout_s)
    if security is None or ctx is None:
        return sock
    try:
        tls = security.connect(sock, ctx)
    except (OSError, ValueError) as exc:
        sock.close()
        raise error(f"TLS with {what} failed (is it started with credentials from the same "
                    f"CA?): {exc}") from exc
    wrong = identity_conflict(tls, role, index)
    if wrong is not None:
        tls.close()
        raise error(f"{what} is not {claims}: {wrong}")
    return tls


def _crypto() -> tuple[Any, Any, Any, Any, Any]:
    """The ``cryptography`` modules certificates need, or ConfigError naming the package."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise ConfigError("making TLS credentials needs the cryptography package "
                          "(pip install 'switchml[tls]'), or make them with openssl") from exc
    return x509, hashes, serialization, ec, NameOID


def _private_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(encoding=serialization.Encoding.PEM,
                             format=serialization.PrivateFormat.PKCS8,
                             encryption_algorithm=serialization.NoEncryption())


def _write_peer(d: Path, ca: Any, ca_key: Any, *, days: int, common_name: str,
                identity: tuple[str, int] | None) -> None:
    """A peer key and certificate signed by ``ca``: ``peer.pem`` and ``peer.key`` in ``d``
    (and ``ca.pem``, unless it is there already), naming ``identity`` if given."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (_certificate(name, ca.subject, key.public_key(), now=now, days=days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False))
    if identity is not None:
        uri = f"{_URI_PREFIX}{identity[0]}:{identity[1]}"
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    pem = serialization.Encoding.PEM
    if not (d / CA_FILE).exists():
        _write_new(d / CA_FILE, ca.public_bytes(pem), 0o644)
    _write_new(d / CERT_FILE, cert.public_bytes(pem), 0o644)
    _write_new(d / KEY_FILE, _private_pem(key), 0o600)


def _certificate(subject: Any, issuer: Any, public_key: Any, *, now: datetime.datetime,
                 days: int) -> Any:
    """A certificate builder for ``subject``'s ``public_key``, issued by ``issuer``, with a
    random serial number, valid from five minutes before ``now`` (clock skew) for ``days``."""
    from cryptography import x509
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path``, which must not exist yet, creating it with ``mode``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def shutdown_descriptor(fd: int) -> None:
    """Shut down the connection on file descriptor ``fd``, whichever socket object holds it
    (a TLS handshake detaches the plain one): the thread blocked on it gets an error and
    closes it. The caller makes sure ``fd`` is still that connection's (the servers call it
    under the lock that a connection's thread takes to leave their table, before it closes
    its socket)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()
