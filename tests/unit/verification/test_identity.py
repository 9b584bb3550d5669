"""Tests for verification.identity: keys, PeerIDs, signatures, key files."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import base58
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from verification.errors import VerificationError
from verification.identity import (
    Domain,
    Identity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
)

SEED = bytes(range(32))
# RFC 8032 test vector 1: secret key and the public key it derives.
RFC8032_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC8032_PUB = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC8032_SIG_EMPTY = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155"
    "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
)


def test_sign_verify_round_trip() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"hello")
    assert len(signature) == 64
    assert verify(identity.peer_id, b"hello", signature)


def _public_key(seed: bytes) -> bytes:
    """The raw Ed25519 public key of ``seed``, derived without :class:`Identity`."""
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()


def test_matches_rfc8032_vector() -> None:
    identity = Identity.from_seed(RFC8032_SEED)
    assert public_key_from_peer_id(identity.peer_id) == RFC8032_PUB
    assert identity.sign(b"") == RFC8032_SIG_EMPTY


def test_tampered_data_signature_or_peer_fail() -> None:
    identity, other = Identity.from_seed(SEED), Identity.generate()
    signature = identity.sign(b"payload")
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify(identity.peer_id, b"payloaD", signature)
    assert not verify(identity.peer_id, b"payload", flipped)
    assert not verify(other.peer_id, b"payload", signature)
    assert not verify(identity.peer_id, b"payload", signature[:-1])
    assert not verify(identity.peer_id, b"payload", signature + b"\x00")


@pytest.mark.parametrize(
    ("peer_id", "data", "signature"),
    [
        ("not-a-peer-id", b"x", bytes(64)),
        ("", b"x", bytes(64)),
        ("1" * 5000, b"x", bytes(64)),
        (None, b"x", bytes(64)),
        (12, b"x", bytes(64)),
        ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", b"x", bytes(64)),
        (Identity.from_seed(SEED).peer_id, "x", bytes(64)),
        (Identity.from_seed(SEED).peer_id, b"x", "not bytes"),
        (Identity.from_seed(SEED).peer_id, b"x", None),
    ],
)
def test_verify_never_raises(peer_id: object, data: object, signature: object) -> None:
    assert verify(peer_id, data, signature) is False  # type: ignore[arg-type]


def test_peer_id_shape_and_inverse() -> None:
    identity = Identity.from_seed(SEED)
    assert identity.peer_id.startswith("12D3KooW")
    public = _public_key(SEED)
    assert identity.peer_id == peer_id_from_public_key(public)
    assert public_key_from_peer_id(identity.peer_id) == public
    assert Identity.from_seed(SEED).peer_id == identity.peer_id
    assert repr(identity) == f"Identity({identity.peer_id})"


def _b58(raw: bytes) -> str:
    return base58.b58encode(raw).decode()


PUB = _public_key(SEED)


@pytest.mark.parametrize(
    "peer_id",
    [
        "",
        "0OIl",  # characters outside the base58 alphabet
        "12D3KooW" + "é" * 10,
        "x" * 1000,
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # sha2-256 (RSA) PeerID
        _b58(bytes([0x00, 0x24, 0x08, 0x02, 0x12, 0x20]) + PUB),  # Secp256k1 key type
        _b58(bytes([0x00, 0x23, 0x08, 0x01, 0x12, 0x1F]) + PUB[:31]),  # short key
        _b58(bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]) + PUB + b"\x00"),  # trailing byte
        _b58(bytes([0x00, 0x24, 0x10, 0x01, 0x12, 0x20]) + PUB),  # wrong protobuf tag
        _b58(bytes([0x11, 0x24, 0x08, 0x01, 0x12, 0x20]) + PUB),  # sha1 multihash code
    ],
)
def test_bad_peer_ids_are_refused(peer_id: str) -> None:
    with pytest.raises(VerificationError) as info:
        public_key_from_peer_id(peer_id)
    assert info.value.reason == "bad_peer_id"
    assert verify(peer_id, b"x", bytes(64)) is False


def test_bad_peer_id_type_is_refused() -> None:
    with pytest.raises(VerificationError):
        public_key_from_peer_id(b"12D3KooW")  # type: ignore[arg-type]


def test_from_seed_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        Identity.from_seed(b"\x00" * 31)
    with pytest.raises(ValueError):
        peer_id_from_public_key(b"\x00" * 33)


def test_save_load_keeps_peer_id_and_mode(tmp_path: Path) -> None:
    identity = Identity.generate()
    path = tmp_path / "key"
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Identity.load(path)
    assert loaded.peer_id == identity.peer_id
    assert verify(identity.peer_id, b"m", loaded.sign(b"m"))
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # no temporary file left


def test_a_restrictive_umask_leaves_the_key_readable_by_its_owner(tmp_path: Path) -> None:
    old = os.umask(0o677)  # would narrow a plain 0600 to nothing
    try:
        Identity.generate().save(tmp_path / "saved")
        Identity.load_or_create(tmp_path / "created")
    finally:
        os.umask(old)
    for name in ("saved", "created"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
        Identity.load(tmp_path / name)


def test_save_overwrites_read_only_file(tmp_path: Path) -> None:
    # hivemind writes its own identity files with mode 0400.
    path = tmp_path / "key"
    Identity.generate().save(path)
    path.chmod(0o400)
    identity = Identity.generate()
    identity.save(path)
    assert Identity.load(path).peer_id == identity.peer_id
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_key_file_layout(tmp_path: Path) -> None:
    identity = Identity.from_seed(SEED)
    identity.save(tmp_path / "key")
    raw = (tmp_path / "key").read_bytes()
    assert raw == bytes([0x08, 0x01, 0x12, 0x40]) + SEED + _public_key(SEED)


def test_load_or_create(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "identity.key"
    created = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == created.peer_id
    assert sorted(p.name for p in path.parent.iterdir()) == ["identity.key"]


def test_load_warns_on_loose_mode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "key"
    identity = Identity.generate()
    identity.save(path)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="verification.identity"):
        assert Identity.load(path).peer_id == identity.peer_id
    assert "chmod 600" in caplog.text


def test_load_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Identity.load(tmp_path / "absent")


def _pb(key_type: int, data: bytes) -> bytes:
    assert len(data) < 128
    return bytes([0x08, key_type, 0x12, len(data)]) + data


_GOOD = SEED + _public_key(SEED)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "empty"),
        (b"\x00" * 5000, "larger"),
        (b"\x08", "truncated"),
        (b"\x08\x01", "missing"),
        (b"\x12\x40" + _GOOD, "missing"),
        (b"\x08\x01\x12\x50" + _GOOD, "past the end"),
        (b"\x08\x01\x1a\x00", "tag"),
        (b"\x08" + b"\xff" * 11, "varint"),
        (_pb(0, _GOOD), "RSA"),
        (_pb(2, _GOOD), "Secp256k1"),
        (_pb(1, SEED), "32 bytes"),
        (_pb(1, SEED + bytes(32)), "does not match"),
        (b"-----BEGIN PRIVATE KEY-----\n", "tag"),
    ],
)
def test_malformed_key_files(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(VerificationError) as info:
        Identity.load(path)
    assert info.value.reason == "bad_key_file"
    assert needle in info.value.detail
    assert str(path) in info.value.detail


def test_legacy_96_byte_key_data_loads(tmp_path: Path) -> None:
    identity = Identity.from_seed(SEED)
    path = tmp_path / "key"
    path.write_bytes(_pb(1, SEED + _public_key(SEED) * 2))
    assert Identity.load(path).peer_id == identity.peer_id


# --- Agreement with hivemind's own encoding ---------------------------------------


def test_encoding_matches_hivemind_protobuf(tmp_path: Path) -> None:
    crypto_pb2 = pytest.importorskip("hivemind.proto.crypto_pb2")
    multihash = pytest.importorskip("multihash")
    from hivemind.p2p import PeerID

    identity = Identity.from_seed(SEED)
    identity.save(tmp_path / "key")

    parsed = crypto_pb2.PrivateKey.FromString((tmp_path / "key").read_bytes())
    assert parsed.key_type == crypto_pb2.Ed25519
    assert parsed.data == SEED + _public_key(SEED)

    public_pb = crypto_pb2.PublicKey(
        key_type=crypto_pb2.Ed25519, data=_public_key(SEED)
    ).SerializeToString()
    expected = PeerID(multihash.encode(public_pb, "id")).to_base58()
    assert identity.peer_id == expected
    assert PeerID.from_base58(identity.peer_id).to_bytes() == base58.b58decode(expected)

    # And a key file written by hivemind's protobuf class loads to the same identity.
    other = tmp_path / "hivemind.key"
    other.write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=parsed.data).SerializeToString()
    )
    other.chmod(0o600)
    assert Identity.load(other).peer_id == identity.peer_id


def test_hivemind_rsa_identity_is_refused_clearly(tmp_path: Path) -> None:
    hivemind_p2p = pytest.importorskip("hivemind.p2p")
    path = tmp_path / "rsa.key"
    hivemind_p2p.P2P.generate_identity(str(path))
    with pytest.raises(VerificationError, match="RSA"):
        Identity.load(path)


def test_hivemind_from_identity_cannot_read_ed25519_files(tmp_path: Path) -> None:
    # Why a swarm with initial_peers needs check_if_identity_free=False: hivemind's
    # PeerID.from_identity assumes an RSA DER key and fails on an Ed25519 key file.
    hivemind_p2p = pytest.importorskip("hivemind.p2p")
    Identity.from_seed(SEED).save(tmp_path / "key")
    with pytest.raises(ValueError):
        hivemind_p2p.PeerID.from_identity((tmp_path / "key").read_bytes())


def test_module_does_not_import_hivemind_or_torch() -> None:
    code = (
        "import sys, verification.identity;"
        "bad = [m for m in ('hivemind', 'torch', 'protocol', 'node') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_p2pd_reports_the_same_peer_id(tmp_path: Path) -> None:
    hivemind_p2p = pytest.importorskip("hivemind.p2p")
    identity = Identity.generate()
    keyfile = tmp_path / "p2p.key"
    identity.save(keyfile)

    async def start_and_stop() -> str:
        p2p = await hivemind_p2p.P2P.create(
            identity_path=str(keyfile), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    assert asyncio.run(asyncio.wait_for(start_and_stop(), 30)) == identity.peer_id
    # p2pd must not have rewritten or replaced the key.
    assert Identity.load(keyfile).peer_id == identity.peer_id
    assert os.stat(keyfile).st_mode & 0o777 == 0o600


def test_a_signature_made_in_one_domain_never_passes_in_another() -> None:
    identity = Identity.from_seed(SEED)
    part, control = Domain(b"atoll/part/v1\0"), Domain(b"atoll/control/v1\0")
    signature = part.sign(identity, b"d" * 32)
    assert part.verify(identity.peer_id, b"d" * 32, signature)
    assert not control.verify(identity.peer_id, b"d" * 32, signature)
    assert not part.verify(identity.peer_id, b"e" * 32, signature)
    assert not part.verify(identity.peer_id, "d" * 32, signature)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="atoll/<kind>/v<N>"):
        Domain(b"part/v1")
