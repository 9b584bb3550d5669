"""The direct data plane's handshake: each side proves its node key, bound to the TLS channel.

Opening a connection (each frame ``u16 length | msgpack``, at most 1 KiB)::

    caller -> callee   [1, caller PeerID, callee PeerID, caller nonce]
    callee -> caller   [callee nonce, callee's signature of DOMAIN_CALLEE + transcript]
    caller -> callee   [caller's signature of DOMAIN_CALLER + transcript]

where the transcript is both nonces (32 random bytes each), both PeerIDs and, on an
encrypted connection, the SHA-256 of the callee's TLS certificate. An Ed25519 PeerID
holds its public key, so each side checks the other's signature against the PeerID the
swarm knows: a callee that is not the peer the caller meant, or a caller whose key
does not match the PeerID it claims, is refused and the connection closed; fresh
nonces on both sides make a recorded handshake useless.

Encryption is optional (``data_plane = "tls"``): the callee then speaks TLS 1.3 with a
certificate it makes for itself at start-up (no CA: nothing outside the swarm vouches
for it; :func:`server_tls`). The handshake above runs inside TLS and binds it: the
callee signs its own certificate's hash and the caller signs the hash of the
certificate it was shown, so a machine in the middle, which must show the caller a
certificate of its own, fails both checks.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import ssl
import struct
import tempfile

import msgpack

from protocol.errors import ProtocolError
from verification.identity import Identity, verify

__all__ = [
    "DOMAIN_CALLEE",
    "DOMAIN_CALLER",
    "VERSION",
    "answer_hello",
    "client_tls",
    "open_hello",
    "server_tls",
]

VERSION = 1
DOMAIN_CALLEE = b"atoll/direct/v1/callee\0"
DOMAIN_CALLER = b"atoll/direct/v1/caller\0"
_NONCE_BYTES = 32
_MAX_HELLO_BYTES = 1024
_HELLO = struct.Struct(">H")


def _transcript(
    nonce_caller: bytes, nonce_callee: bytes, caller: str, callee: str, channel: bytes
) -> bytes:
    """What both sides sign; ``channel`` is the callee's certificate hash under TLS."""
    return nonce_caller + nonce_callee + caller.encode() + b"\0" + callee.encode() + b"\0" + channel


def server_tls() -> tuple[ssl.SSLContext, bytes]:
    """A TLS 1.3 server context with a fresh self-signed certificate, and its SHA-256.

    The certificate only carries a key for TLS; who the callee is, the signed handshake
    says (it binds this hash)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "atoll-direct")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # load_cert_chain reads files only: a private folder, removed as soon as it is read
    with tempfile.TemporaryDirectory(prefix="atoll-tls-") as folder:
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        context.load_cert_chain(cert_path, key_path)
    return context, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def client_tls() -> ssl.SSLContext:
    """TLS 1.3 without a CA: the signed handshake checks the certificate instead."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _peer_certificate_hash(writer: asyncio.StreamWriter) -> bytes:
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return b""
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise ProtocolError("malformed", "TLS callee showed no certificate")
    return hashlib.sha256(der).digest()


async def _write_hello(writer: asyncio.StreamWriter, fields: list) -> None:
    body = msgpack.packb(fields, use_bin_type=True)
    writer.write(_HELLO.pack(len(body)) + body)
    await writer.drain()


async def _read_hello(reader: asyncio.StreamReader, count: int) -> list:
    (length,) = _HELLO.unpack(await reader.readexactly(_HELLO.size))
    if length > _MAX_HELLO_BYTES:
        raise ProtocolError("malformed", f"handshake frame of {length} bytes")
    try:
        fields = msgpack.unpackb(await reader.readexactly(length), raw=False, max_bin_len=128)
    except (ValueError, msgpack.UnpackException, TypeError):
        raise ProtocolError("malformed", "unreadable handshake frame") from None
    if not isinstance(fields, list) or len(fields) != count:
        raise ProtocolError("malformed", "handshake frame of the wrong shape")
    return fields


def _bytes_field(value: object, size: int, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError("malformed", f"{what} must be {size} bytes")
    return value


async def answer_hello(
    identity: Identity,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    certificate_hash: bytes = b"",
) -> str:
    """The callee's side of the handshake; returns the caller's proven PeerID.

    Args:
        identity: this node's key.
        reader: the new connection's reader.
        writer: the new connection's writer.
        certificate_hash: SHA-256 of this node's TLS certificate (empty on plain TCP).

    Raises:
        ProtocolError: ``bad_version``, ``malformed``, ``wrong_peer`` (the caller means
            another node) or ``bad_signature``.
    """
    version, caller, callee, nonce_caller = await _read_hello(reader, 4)
    if version != VERSION:
        raise ProtocolError("bad_version", f"direct handshake version {version!r}")
    if not isinstance(caller, str) or not isinstance(callee, str) or len(caller) > 128:
        raise ProtocolError("malformed", "PeerIDs must be strings")
    if callee != identity.peer_id:
        raise ProtocolError("wrong_peer", f"this node is not {callee[:16]}")
    nonce_caller = _bytes_field(nonce_caller, _NONCE_BYTES, "nonce")
    nonce_callee = os.urandom(_NONCE_BYTES)
    transcript = _transcript(nonce_caller, nonce_callee, caller, callee, certificate_hash)
    await _write_hello(writer, [nonce_callee, identity.sign(DOMAIN_CALLEE + transcript)])
    (signature,) = await _read_hello(reader, 1)
    if not verify(caller, DOMAIN_CALLER + transcript, signature):
        raise ProtocolError("bad_signature", f"caller's key does not match {caller[:16]}")
    return caller


async def open_hello(
    identity: Identity, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """The caller's side of the handshake with ``peer``.

    Raises:
        ProtocolError: ``malformed``, or ``bad_signature`` when the callee is not ``peer``.
    """
    me = identity.peer_id
    nonce_caller = os.urandom(_NONCE_BYTES)
    await _write_hello(writer, [VERSION, me, peer, nonce_caller])
    nonce_callee, signature = await _read_hello(reader, 2)
    nonce_callee = _bytes_field(nonce_callee, _NONCE_BYTES, "nonce")
    # the certificate this connection was shown: the callee signs the one it holds
    transcript = _transcript(nonce_caller, nonce_callee, me, peer, _peer_certificate_hash(writer))
    if not verify(peer, DOMAIN_CALLEE + transcript, signature):
        raise ProtocolError("bad_signature", f"the callee is not {peer[:16]}", peer)
    await _write_hello(writer, [identity.sign(DOMAIN_CALLER + transcript)])
