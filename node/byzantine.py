"""Fault injection for tests and benchmarks: ``atoll run --byzantine MODE``.

Each mode is a :class:`~protocol.averaging.parts.FaultInjection` that corrupts what the node sends
in one specific way, so defences are tested against real nodes over the real wire
rather than against mocks. Modes that need knowledge of the honest peers' updates
(ALIE, IPM) use this node's own pseudo-gradient as the estimate of the honest mean,
which is what a colluding-free attacker can do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import struct
from collections.abc import Sequence

import torch

from node.fault_modes import ALL_MODES, COMMIT_MODES, MODES, QUIET_MODES
from protocol.averaging.parts import Commitments, FaultInjection
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart
from verification.identity import Identity

__all__ = ["ALL_MODES", "COMMIT_MODES", "MODES", "QUIET_MODES", "make_behaviour", "training_data"]


_LATE_COMMIT_SECONDS = 4.0  # past the tests' commit phase (2 s), within their deadline (8 s)
_SCALE = 50.0
_NOISE = 10.0
_ALIE_Z = 1.0  # Baruch et al. 2019 pick z from n and f; 1.0 is their order of magnitude
_IPM_EPS = 0.5  # Xie et al. 2020: -eps * mean of honest updates


class _VectorAttack(FaultInjection):
    def __init__(self, mode: str, seed: int) -> None:
        self.mode = mode
        self.generator = torch.Generator().manual_seed(seed)

    def contribution(self, round_: int, fragment: int, vector: torch.Tensor) -> torch.Tensor:
        if self.mode == "sign_flip":
            return -vector
        if self.mode == "scale":
            return vector * _SCALE
        if self.mode == "zero":
            return torch.zeros_like(vector)
        if self.mode == "noise":
            rms = vector.pow(2).mean().sqrt().clamp_min(1e-8)
            noise = torch.randn(vector.shape, generator=self.generator)
            return vector + _NOISE * rms * noise
        if self.mode == "alie":
            # "A Little Is Enough": mu - z * sigma, a shift small enough to pass screens.
            return vector - _ALIE_Z * vector.abs()
        if self.mode == "ipm":
            return -_IPM_EPS * vector
        raise AssertionError(self.mode)


class _WireAttack(FaultInjection):
    """Corrupts the signed part message itself."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._first: dict[tuple[int, int, str], SealedPart] = {}

    def request(
        self, identity: Identity, header: Header, meta: dict, encoded: codecs.Encoded
    ) -> SealedPart:
        if self.mode == "replay":
            # The first message sent for this (fragment, part, content), resent in every
            # later round.
            key = (header.fragment, header.part, str(meta.get("content")))
            if key not in self._first:  # kept: its own copy of the body
                copied = dataclasses.replace(encoded, payload=bytes(encoded.payload))
                self._first[key] = super().request(identity, header, meta, copied)
            return self._first[key]
        honest = super().request(identity, header, meta, encoded)
        if self.mode == "bad_signature":
            signature = bytearray(honest.signature)
            signature[-1] ^= 0x01
            return dataclasses.replace(honest, signature=bytes(signature))
        if self.mode == "inflated_tokens":
            return super().request(identity, header, dict(meta, weight=10**12), encoded)
        if self.mode == "wrong_shape":
            longer = torch.cat([codecs.decode(encoded), torch.zeros(1)])
            enc = codecs.encode(
                longer, encoded.codec, block_size=encoded.block_size, k=encoded.k, bits=encoded.bits
            )
            return super().request(identity, header, meta, enc)
        if self.mode == "nan":
            return super().request(identity, header, meta, _nan(encoded))
        raise AssertionError(self.mode)


class _CommitAttack(FaultInjection):
    """Cheats in the commit phase; the parts it sends are honest."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def commit(
        self,
        commitments: Commitments,
        round_: int,
        fragment: int,
        group: Sequence[str],
        digests: dict[int, bytes],
        content: str = "update",
    ) -> None:
        if self.mode == "skip_commit":
            return
        if self.mode == "late_commit":
            # Commit only once every owner's commit phase has closed, then send the parts.
            await asyncio.sleep(_LATE_COMMIT_SECONDS)
            await commitments.commit(round_, fragment, (), digests, content)
            return
        # equivocate: commit to other parts first, then to the real ones
        other = {j: hashlib.sha256(b"other" + d).digest() for j, d in digests.items()}
        await commitments.commit(round_, fragment, (), other, content)
        await commitments.commit(round_, fragment, group, digests, content)


class _BadOwner(FaultInjection):
    """Claims, in every signed result it returns, inputs nobody committed to."""

    def reduced_meta(self, meta: dict) -> dict:
        forged = [hashlib.sha256(b"forged" + d).digest() for d in meta["digests"]]
        return dict(meta, digests=forged)


class _MaliciousOwner(FaultInjection):
    """Reduces honestly received parts into something that would wreck the model."""

    stream_results = False  # the values it sends are made only at the end

    def reduced(self, vector: torch.Tensor) -> torch.Tensor:
        return -10.0 * vector - 1.0


def _nan(encoded: codecs.Encoded) -> codecs.Encoded:
    """The same part with its first value (or block scale) replaced by NaN."""
    nan32 = struct.pack("<f", float("nan"))
    payload = bytearray(encoded.payload)
    if encoded.codec in ("none", "int8", "int4", *codecs.SPARSE):
        payload[0:4] = nan32  # raw value, or the first block's (chunk's) scale
    else:
        payload[0:2] = b"\xff\x7f" if encoded.codec == "fp16" else b"\xc0\x7f"
    return dataclasses.replace(encoded, payload=bytes(payload))


class _Silent(FaultInjection):
    """Takes part in matchmaking and the commit phase, then goes quiet."""

    silent = True


def training_data(mode: str | None, data: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The bytes a node trains on: ``data``, or as many random bytes for ``random_data``."""
    if mode != "random_data":
        return data
    generator = torch.Generator().manual_seed(seed + 7919)
    return torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator)


def make_behaviour(mode: str | None, seed: int = 0) -> FaultInjection:
    """The behaviour for ``mode`` (None or ``"honest"`` is honest).

    Raises:
        ValueError: an unknown mode, naming the known ones.
    """
    if mode in (None, "", "honest"):
        return FaultInjection()
    if mode in ("sign_flip", "scale", "noise", "zero", "alie", "ipm"):
        return _VectorAttack(mode, seed)
    if mode in ("replay", "bad_signature", "inflated_tokens", "wrong_shape", "nan"):
        return _WireAttack(mode)
    if mode == "malicious_owner":
        return _MaliciousOwner()
    if mode == "bad_owner":
        return _BadOwner()
    if mode in COMMIT_MODES:
        return _CommitAttack(mode)
    if mode == "silent":
        return _Silent()
    if mode == "random_data":
        return FaultInjection()  # its all-reduce is honest; its data is not (training_data)
    raise ValueError(f"--byzantine {mode!r}: expected one of {', '.join(ALL_MODES)}")
