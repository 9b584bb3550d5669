"""Fault injection for tests and benchmarks: ``atoll run --byzantine MODE``.

Each mode is a :class:`~protocol.averaging.hooks.FaultInjection` that corrupts what the node sends
in one specific way, so defences are tested against real nodes over the real wire
rather than against mocks. Modes that need knowledge of the honest peers' updates
(ALIE, IPM) use this node's own pseudo-gradient as the estimate of the honest mean,
which is what a colluding-free attacker can do. The quiet modes that corrupt no message
act elsewhere: on the data (:func:`training_data`), on the inner loop
(:func:`trainer_class`), or on the update from the node's global copies (``copy``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import struct
from collections.abc import Callable, Sequence

import torch
from torch import nn

from node.config import TrainConfig
from node.data.corpus import BatchStream
from node.swarm.fault_modes import ALL_MODES, COMMIT_MODES, MODES, QUIET_MODES, parse_mode
from node.train.trainer import InnerTrainer, StepResult, lr_at
from protocol.averaging.hooks import FaultInjection
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart

__all__ = [
    "ALL_MODES",
    "COMMIT_MODES",
    "MODES",
    "QUIET_MODES",
    "make_behaviour",
    "trainer_class",
    "training_data",
]


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

    def part(self, meta: dict, encoded: codecs.Encoded) -> tuple[dict, codecs.Encoded]:
        if self.mode == "inflated_tokens":
            return dict(meta, weight=10**12), encoded
        if self.mode == "wrong_shape":
            longer = torch.cat([codecs.decode(encoded), torch.zeros(1)])
            enc = codecs.encode(
                longer, encoded.codec, block_size=encoded.block_size, k=encoded.k, bits=encoded.bits
            )
            return meta, enc
        if self.mode == "nan":
            return meta, _nan(encoded)
        return meta, encoded

    def sealed(self, header: Header, meta: dict, sealed: SealedPart) -> SealedPart:
        if self.mode == "replay":
            # The first message sent for this (fragment, part, content), resent in every
            # later round.
            key = (header.fragment, header.part, str(meta.get("content")))
            if key not in self._first:  # kept: its own copy of the body
                body = memoryview(bytes(sealed.body))
                self._first[key] = dataclasses.replace(sealed, body=body)
            return self._first[key]
        if self.mode == "bad_signature":
            signature = bytearray(sealed.signature)
            signature[-1] ^= 0x01
            return dataclasses.replace(sealed, signature=bytes(signature))
        return sealed


class _CommitAttack(FaultInjection):
    """Cheats in the commit phase; the parts it sends are honest."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # late_commit: commit only once every owner's commit phase has closed
        self.commit_delay = _LATE_COMMIT_SECONDS if mode == "late_commit" else 0.0

    def commits(
        self, group: Sequence[str], digests: dict[int, bytes]
    ) -> list[tuple[Sequence[str], dict[int, bytes]]]:
        if self.mode == "skip_commit":
            return []
        if self.mode == "late_commit":
            return [((), digests)]
        # equivocate: commit to other parts first, then to the real ones
        other = {j: hashlib.sha256(b"other" + d).digest() for j, d in digests.items()}
        return [((), other), (group, digests)]


class _Split(FaultInjection):
    """In a gather, sends the first other member of its group another part than the one
    it committed to and sent the rest: the same values, one token more claimed."""

    def sent_to(self, j: int, header: Header, meta: dict) -> dict:
        if j != (0 if header.part else 1):  # the first member other than this node
            return meta
        return dict(meta, weight=meta["weight"] + 1)


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
    """Takes part in matchmaking and the commit phase, then goes quiet: in every
    exchange, or in the share ``share`` of them (drawn from the round, the fragment and
    ``seed``: the same exchanges in every run of one seed)."""

    def __init__(self, share: float, seed: int) -> None:
        self.share = share
        self.seed = seed
        self.silent = share >= 1.0

    def silent_in(self, round_: int, fragment: int) -> bool:
        if self.silent:
            return True
        key = f"{self.seed}:{round_}:{fragment}".encode()
        draw = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
        return draw < self.share


class _CopyAttack(FaultInjection):
    """Sends, for a fragment, the swarm's last change of its global copy instead of its
    own work: the fragment's global at this node's previous sync of it minus its global
    now, shaped and sized like an honest update and trained on nothing. Zeros on a
    fragment's first sync.

    It keeps one copy of every fragment's global (a model's worth of memory). When the
    group mixes global copies, the fragment's second exchange in a round (its
    ``weights``, started right after the update's) is sent as it is.

    Args:
        global_vector: the node's global copy of a fragment, flat
            (:meth:`node.train.outer.OuterOptimizer.global_vector`).
    """

    def __init__(self, global_vector: Callable[[int], torch.Tensor]) -> None:
        self.global_vector = global_vector
        self.before: dict[int, torch.Tensor] = {}
        self.rounds: dict[int, int] = {}

    def contribution(self, round_: int, fragment: int, vector: torch.Tensor) -> torch.Tensor:
        if self.rounds.get(fragment) == round_:
            return vector  # the group's mixing of global copies, beside the update
        self.rounds[fragment] = round_
        # read on the exchange's thread: a fragment's global only changes once its sync
        # is applied, and its next sync starts after that
        now = self.global_vector(fragment)
        before = self.before.get(fragment)
        self.before[fragment] = now
        if before is None:
            return torch.zeros_like(vector)
        return (before - now).to(device=vector.device, dtype=vector.dtype).view_as(vector)


def _no_global_vector(fragment: int) -> torch.Tensor:
    raise AssertionError("--byzantine copy needs the node's global copies (global_vector)")


class _LazyTrainer(InnerTrainer):
    """Runs the share ``share`` of its inner steps (with 0.1: the first, the eleventh,
    ...) and counts every one: the others draw no batch, run no forward or backward pass
    and leave the weights and the optimizer as they are, yet advance ``steps`` and
    ``tokens`` as a real step would and report the last real loss. Its updates are
    honest but ``share`` as long as the tokens they claim.

    Takes :class:`~node.train.trainer.InnerTrainer`'s arguments, and ``share``.

    Raises:
        ValueError: ``ranks > 1``: a site's ranks would wait for the steps it skips.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        stream: BatchStream,
        device: torch.device | str = "cpu",
        ranks: int = 1,
        share: float = 0.1,
    ) -> None:
        if ranks > 1:
            raise ValueError("--byzantine lazy: a site's ranks train in step; run it alone")
        super().__init__(model, cfg, stream, device, ranks)
        self.share = share
        self.calls = 0
        self.last_loss = float("nan")

    def step(self) -> StepResult:
        """A real step where the running count of real steps, ``ceil(calls * share)``,
        goes up; a counted one otherwise."""
        self.calls += 1
        if math.ceil(self.calls * self.share - 1e-9) > math.ceil(
            (self.calls - 1) * self.share - 1e-9
        ):
            result = super().step()
            self.last_loss = result.loss
            return result
        lr = lr_at(self.steps, self.cfg)
        stream = self.stream
        tokens = self.cfg.grad_accum * stream.batch_size * stream.context * self.ranks
        self.steps += 1
        self.tokens += tokens
        return StepResult(loss=self.last_loss, tokens=tokens, lr=lr)


def trainer_class(mode: str | None) -> Callable[..., InnerTrainer]:
    """The inner trainer a node runs: :class:`~node.train.trainer.InnerTrainer`, or for
    ``lazy`` (``lazy=F``) one that runs a tenth (``F``) of its steps and counts them all."""
    if mode is None or not mode.startswith("lazy"):
        return InnerTrainer
    _, share = parse_mode(mode)
    return functools.partial(_LazyTrainer, share=share)


def training_data(mode: str | None, data: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The tokens a node trains on: ``data``, as many random bytes for ``random_data``,
    or ``data`` in reverse order for ``poison``.

    ``poison`` reads all of ``data`` into memory (``flip`` makes a reversed copy; a
    memory map's pages are read once, for it); every other mode keeps ``data`` as it is.
    """
    if mode == "poison":
        return data.flip(0)
    if mode != "random_data":
        return data
    generator = torch.Generator().manual_seed(seed + 7919)
    return torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator)


def make_behaviour(
    mode: str | None,
    seed: int = 0,
    global_vector: Callable[[int], torch.Tensor] | None = None,
) -> FaultInjection:
    """The behaviour for ``mode`` (None or ``"honest"`` is honest).

    Args:
        mode: a name from :data:`ALL_MODES`, or None.
        seed: seeds the modes that draw random numbers.
        global_vector: the node's global copy of a fragment, flat (``copy`` reads it;
            :meth:`node.train.outer.OuterOptimizer.global_vector`).

    Raises:
        ValueError: an unknown mode, naming the known ones.
    """
    if mode in (None, "", "honest"):
        return FaultInjection()
    mode, share = parse_mode(mode)
    if mode in ("sign_flip", "scale", "noise", "zero", "alie", "ipm"):
        return _VectorAttack(mode, seed)
    if mode in ("replay", "bad_signature", "inflated_tokens", "wrong_shape", "nan"):
        return _WireAttack(mode)
    if mode == "malicious_owner":
        return _MaliciousOwner()
    if mode == "bad_owner":
        return _BadOwner()
    if mode == "split":
        return _Split()
    if mode in COMMIT_MODES:
        return _CommitAttack(mode)
    if mode == "silent":
        return _Silent(1.0 if share is None else share, seed)
    if mode in ("random_data", "poison", "lazy"):
        # its all-reduce is honest; its data (training_data) or its inner loop
        # (trainer_class) is not
        return FaultInjection()
    if mode == "copy":
        return _CopyAttack(global_vector if global_vector is not None else _no_global_vector)
    raise ValueError(f"--byzantine {mode!r}: expected one of {', '.join(ALL_MODES)}")
