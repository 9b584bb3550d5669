"""Node identity: one Ed25519 key, its libp2p PeerID, and signatures checked from a PeerID alone.

The key lives on disk as a libp2p private-key file (the protobuf ``PrivateKey`` that
go-libp2p and p2pd read), so the same file gives hivemind's p2pd its PeerID and gives
Atoll its message signatures. An Ed25519 PeerID is an *identity* multihash of the
protobuf ``PublicKey``, so a receiver recovers the public key from the PeerID itself
and needs no key exchange to verify a signature.

The protobuf messages are tiny and fixed (two fields), so they are encoded here by
hand instead of importing hivemind's generated classes: this package must stay
importable without hivemind or torch.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from verification.errors import VerificationError
from verification.files import atomic_write

__all__ = [
    "Domain",
    "Identity",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "verify",
]

logger = logging.getLogger(__name__)

_SEED_LEN = 32
_KEY_FILE = {"perms": 0o600, "replace": False}
"""How a key file is written (:func:`verification.files.atomic_file`): created 0600
under a temporary name (never readable by others, not even briefly; a planted symlink
there is refused, not followed), and published by a hard link that fails where another
process wrote the key first."""
_PUBLIC_KEY_LEN = 32
_SIGNATURE_LEN = 64

# libp2p crypto.pb.KeyType values.
_KEY_TYPE_NAMES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}
_ED25519 = 1

# Protobuf tags: field 1 (Type) as varint, field 2 (Data) as length-delimited bytes.
_TAG_TYPE = 0x08
_TAG_DATA = 0x12

# Multihash codes: "identity" keeps the bytes as they are; libp2p uses it for keys of
# at most 42 encoded bytes, which includes every Ed25519 key.
_MH_IDENTITY = 0x00
_MH_SHA2_256 = 0x12

# protobuf PublicKey{Type=Ed25519, Data=<32 bytes>} starts with these four bytes.
_PUBLIC_KEY_PB_PREFIX = bytes([_TAG_TYPE, _ED25519, _TAG_DATA, _PUBLIC_KEY_LEN])
_PEER_ID_PREFIX = bytes([_MH_IDENTITY, len(_PUBLIC_KEY_PB_PREFIX) + _PUBLIC_KEY_LEN])
_PEER_ID_BYTES_LEN = len(_PEER_ID_PREFIX) + len(_PUBLIC_KEY_PB_PREFIX) + _PUBLIC_KEY_LEN

# A base58 Ed25519 PeerID is 52 characters; anything far longer is refused before
# decoding, because base58 decoding is quadratic in the input length.
_MAX_PEER_ID_CHARS = 128
# A well-formed key file is 68 bytes (or 100 in go-libp2p's legacy layout).
_MAX_KEY_FILE_BYTES = 4096


class Identity:
    """One node's Ed25519 key.

    Build one with :meth:`generate`, :meth:`from_seed`, :meth:`load` or
    :meth:`load_or_create`; the constructor is private to this module.
    """

    __slots__ = ("_private_key", "_public_key_bytes", "_peer_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._public_key_bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._peer_id = peer_id_from_public_key(self._public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        """Create a fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Derive the identity for a 32-byte Ed25519 seed (the RFC 8032 private key).

        Raises:
            ValueError: if ``seed`` is not exactly 32 bytes.
        """
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != _SEED_LEN:
            raise ValueError(f"an Ed25519 seed is {_SEED_LEN} bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read a libp2p private-key file holding an Ed25519 key.

        A file readable by group or others still loads, with a warning: refusing it
        would stop a node over a fixable permission, and the key is already exposed.

        Raises:
            OSError: if the file cannot be read (``FileNotFoundError`` if it is missing).
            VerificationError: ``bad_key_file`` if the contents are not an Ed25519
                libp2p private key.
        """
        path = Path(path)
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
        if stat.S_IMODE(mode) & 0o077:
            logger.warning(
                "identity key %s has mode %o; it should be readable by its owner only (chmod 600)",
                path,
                stat.S_IMODE(mode),
            )
        try:
            return cls(_decode_private_key_file(data))
        except VerificationError as e:
            raise VerificationError("bad_key_file", f"{path}: {e.detail}") from None

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Load the key at ``path``, or create it (and its parent directories) if missing.

        Creation never replaces a file another process wrote in the meantime: the new
        key is published with a hard link, which fails if the name is taken, and in
        that case the other process's key is loaded instead.

        Raises:
            OSError: if the file or its directory cannot be read or written.
            VerificationError: ``bad_key_file`` if an existing file is malformed.
        """
        path = Path(path)
        try:
            return cls.load(path)
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = cls.generate()
        try:
            atomic_write(path, identity._key_file_bytes(), **_KEY_FILE)
        except FileExistsError:
            return cls.load(path)
        logger.info("created identity %s at %s", identity.peer_id, path)
        return identity

    def save(self, path: Path) -> None:
        """Write the key as a libp2p private-key file with mode 0600, atomically.

        The file is written under a temporary name created with mode 0600 (so the key
        is never readable by others, not even briefly), fsynced, then renamed over
        ``path``.

        Raises:
            OSError: if the file cannot be written.
        """
        atomic_write(Path(path), self._key_file_bytes(), perms=0o600)

    @property
    def peer_id(self) -> str:
        """The libp2p PeerID in base58 (``12D3KooW...``), as p2pd reports it."""
        return self._peer_id

    def sign(self, data: bytes) -> bytes:
        """Sign ``data``; returns the 64-byte Ed25519 signature."""
        return self._private_key.sign(bytes(data))

    def __repr__(self) -> str:
        # Never show key material, only the public name.
        return f"Identity({self._peer_id})"

    def _key_file_bytes(self) -> bytes:
        seed = self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        # go-libp2p stores an Ed25519 private key as seed || public key (64 bytes).
        return _encode_key_pb(seed + self._public_key_bytes)


def peer_id_from_public_key(pub: bytes) -> str:
    """The base58 libp2p PeerID of a raw 32-byte Ed25519 public key.

    Raises:
        ValueError: if ``pub`` is not 32 bytes.
    """
    if not isinstance(pub, (bytes, bytearray)) or len(pub) != _PUBLIC_KEY_LEN:
        raise ValueError(f"an Ed25519 public key is {_PUBLIC_KEY_LEN} bytes")
    return base58.b58encode(_PEER_ID_PREFIX + _PUBLIC_KEY_PB_PREFIX + bytes(pub)).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Recover the raw 32-byte Ed25519 public key embedded in a PeerID.

    Raises:
        VerificationError: ``bad_peer_id`` if ``peer_id`` is not valid base58, not an
            identity multihash, or does not hold an Ed25519 key.
    """
    if not isinstance(peer_id, str):
        raise VerificationError("bad_peer_id", f"expected a str, got {type(peer_id).__name__}")
    return _public_key_from_peer_id(peer_id)


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``peer_id``'s Ed25519 signature over ``data``.

    Never raises: a malformed PeerID, a signature of the wrong length or type, or
    non-bytes data all count as a failed verification.
    """
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != _SIGNATURE_LEN:
        return False
    if not isinstance(data, (bytes, bytearray, memoryview)) or not isinstance(peer_id, str):
        return False
    try:
        key = _verifier(peer_id)
        key.verify(bytes(signature), bytes(data))
    except (VerificationError, InvalidSignature, ValueError, TypeError):
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _public_key_from_peer_id(peer_id: str) -> bytes:
    # Only successful decodes are cached (lru_cache does not cache exceptions), so
    # garbage from peers cannot evict real entries beyond normal LRU turnover.
    if not peer_id or len(peer_id) > _MAX_PEER_ID_CHARS:
        raise VerificationError("bad_peer_id", f"length {len(peer_id)} is not a PeerID")
    try:
        raw = base58.b58decode(peer_id.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise VerificationError("bad_peer_id", "not base58") from None
    if raw[:1] == bytes([_MH_SHA2_256]):
        raise VerificationError(
            "bad_peer_id", "sha2-256 multihash: the key is hashed (RSA or ECDSA), not Ed25519"
        )
    if raw[:1] != bytes([_MH_IDENTITY]):
        raise VerificationError("bad_peer_id", "not an identity multihash")
    if raw[: len(_PEER_ID_PREFIX)] != _PEER_ID_PREFIX or len(raw) != _PEER_ID_BYTES_LEN:
        raise VerificationError("bad_peer_id", "identity multihash of the wrong length")
    key_pb = raw[len(_PEER_ID_PREFIX) :]
    if key_pb[:2] != bytes([_TAG_TYPE, _ED25519]):
        raise VerificationError("bad_peer_id", "key type is not Ed25519")
    if key_pb[: len(_PUBLIC_KEY_PB_PREFIX)] != _PUBLIC_KEY_PB_PREFIX:
        raise VerificationError("bad_peer_id", "malformed PublicKey protobuf")
    return key_pb[len(_PUBLIC_KEY_PB_PREFIX) :]


@functools.lru_cache(maxsize=4096)
def _verifier(peer_id: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if pos >= len(data):
            raise VerificationError(
                "bad_key_file", "truncated: a varint runs past the end of the file"
            )
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise VerificationError("bad_key_file", "varint longer than 10 bytes")


def _encode_key_pb(key_data: bytes) -> bytes:
    return bytes([_TAG_TYPE, _ED25519, _TAG_DATA]) + _encode_varint(len(key_data)) + key_data


def _parse_key_pb(data: bytes) -> tuple[int, bytes]:
    """Parse protobuf ``PrivateKey{Type, Data}``; returns (key type, data)."""
    key_type: int | None = None
    key_data: bytes | None = None
    pos = 0
    while pos < len(data):
        tag, pos = _decode_varint(data, pos)
        if tag == _TAG_TYPE:
            key_type, pos = _decode_varint(data, pos)
        elif tag == _TAG_DATA:
            length, pos = _decode_varint(data, pos)
            if pos + length > len(data):
                raise VerificationError(
                    "bad_key_file", "truncated: the key data runs past the end of the file"
                )
            key_data, pos = data[pos : pos + length], pos + length
        else:
            raise VerificationError(
                "bad_key_file", f"not a libp2p private-key file: unexpected protobuf tag {tag:#x}"
            )
    if key_type is None or key_data is None:
        raise VerificationError("bad_key_file", "not a libp2p PrivateKey (Type or Data missing)")
    return key_type, key_data


def _decode_private_key_file(data: bytes) -> Ed25519PrivateKey:
    if not data:
        raise VerificationError("bad_key_file", "the file is empty")
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise VerificationError("bad_key_file", f"larger than {_MAX_KEY_FILE_BYTES} bytes")
    key_type, key_data = _parse_key_pb(data)
    if key_type != _ED25519:
        name = _KEY_TYPE_NAMES.get(key_type, "unknown")
        raise VerificationError(
            "bad_key_file", f"key type {name} ({key_type}) is not supported; Atoll needs Ed25519"
        )
    # 64 bytes = seed || public key; go-libp2p also still reads a legacy 96-byte
    # layout with the public key repeated, so accept that too.
    if len(key_data) == 96 and key_data[32:64] == key_data[64:96]:
        key_data = key_data[:64]
    if len(key_data) != 2 * _SEED_LEN:
        raise VerificationError(
            "bad_key_file", f"Ed25519 key data is {len(key_data)} bytes, expected 64"
        )
    private_key = Ed25519PrivateKey.from_private_bytes(key_data[:_SEED_LEN])
    derived = private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    if derived != key_data[_SEED_LEN:]:
        raise VerificationError("bad_key_file", "stored public key does not match the seed")
    return private_key


class Domain:
    """One kind of signed message: the key signs ``prefix + digest``, so that a signature
    made for one kind never passes for another. Every signed message of Atoll is signed
    and checked through one of these.

    Args:
        prefix: the kind's name, ``atoll/<kind>/v<N>\\0``.
    """

    __slots__ = ("prefix",)

    def __init__(self, prefix: bytes) -> None:
        if not prefix.startswith(b"atoll/") or not prefix.endswith(b"\0"):
            raise ValueError(f"a signing domain is atoll/<kind>/v<N> and a NUL, not {prefix!r}")
        self.prefix = prefix

    def sign(self, identity: Identity, digest: bytes) -> bytes:
        """``identity``'s signature over a message of this kind whose digest is ``digest``."""
        return identity.sign(self.prefix + bytes(digest))

    def verify(self, sender: str, digest: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is ``sender``'s over a message of this kind whose digest is
        ``digest`` (never raises, as :func:`verify`)."""
        if not isinstance(digest, (bytes, bytearray, memoryview)):
            return False
        return verify(sender, self.prefix + bytes(digest), signature)

    def __repr__(self) -> str:
        return f"Domain({self.prefix!r})"
