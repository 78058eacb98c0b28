"""``%ddp attach --tls``: a self-signed certificate for one pool, pinned by its fingerprint.

The notebook makes a new key and certificate for each pool that attaches with
--tls (an ECDSA P-256 key, valid for 30 days, made with ``cryptography``); the
key never leaves the notebook's memory but for the moment :mod:`ssl` loads it.
The certificate's SHA-256 goes into the token file, and ranks and relays accept
only the notebook that shows that certificate: there is no CA to trust and no
host name to check, so it works the same on any cluster network.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl

__all__ = ["Tls", "make_server_tls", "pin_listener", "pinned_client_tls", "server_credentials"]


class Tls:
    """What TLS needs on one side: the server's certificate and key (PEM), or the client's
    pinned SHA-256 of the server's certificate (hex)."""

    def __init__(self, *, cert: bytes = b"", key: bytes = b"", pin: str = "") -> None:
        self.pin = pin.lower()
        self.fingerprint = ""  # a server's: its certificate's SHA-256 (what clients pin)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if cert else ssl.PROTOCOL_TLS_CLIENT)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert:
            _load_pem(self.context, cert, key)
        else:  # trust is the pin, checked after the handshake; no CA, no host name
            self.context.check_hostname = False
            self.context.verify_mode = ssl.CERT_NONE


def _load_pem(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """ssl loads certificates only from files: a private folder, removed at once."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nbddp-tls-") as folder:  # mode 0700
        paths = []
        for name, data in (("cert.pem", cert), ("key.pem", key)):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(path)
        context.load_cert_chain(*paths)


def server_credentials(token_file: str, tls: bool) -> tuple[bytes, Tls | None]:
    """What a listener for attached ranks needs: the token in ``token_file`` (made if
    missing) and, with ``tls``, a new certificate whose fingerprint the file then pins
    (without, it pins none: the ranks of the last pool attached with it read how to
    connect there). Where the listener runs (the kernel, a detached pool's supervisor)
    makes them: the key never leaves that process's memory. UnsafeFile: the file is not
    private."""
    from .private import write_token_file

    server, pin = make_server_tls() if tls else (None, "")
    return write_token_file(token_file, pin).token, server


def make_server_tls() -> tuple[Tls, str]:
    """A new certificate and key: the server's side of TLS, and the fingerprint to pin."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nbddp notebook")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(key, hashes.SHA256())
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    server, pin = Tls(cert=cert_pem, key=key_pem), hashlib.sha256(der).hexdigest()
    server.fingerprint = pin
    return server, pin


def pin_listener(token_file: str, tls: Tls | None, address: str) -> None:
    """The listener at ``address`` is bound: its pin (none without TLS) goes into the token
    file under its port too, where a host of this pool that comes back after a later
    attach rewrote the file's pin still finds it (``TokenFile.pin_for``)."""
    from .private import write_token_file

    write_token_file(token_file, tls.fingerprint if tls else "", int(address.rsplit(":", 1)[1]))


def pinned_client_tls(pin: str) -> Tls | None:
    """The client's side of TLS for a token file's pin (None: the pool does not use TLS)."""
    return Tls(pin=pin) if pin else None
