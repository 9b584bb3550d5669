"""Error feedback: the residual a lossy codec dropped, carried into the next encode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.wire._tensorbytes import as_flat_f32
from protocol.wire.codec import Encoded, check_settings, decode, encode

__all__ = ["ErrorFeedback", "FeedbackSettings"]


@dataclass(frozen=True)
class FeedbackSettings:
    """How an :class:`ErrorFeedback` encodes, checked when made.

    Args:
        codec: one of ``CODECS``.
        block_size: values per scale for int8/int4, per chunk for topk.
        stochastic: use stochastic rounding (int8/int4/topk only).
        pin_memory: keep the residual in pinned (page-locked) CPU memory, beside a
            GPU's model (needs CUDA).
        k: values ``topk`` keeps per chunk.
        bits: bits per value ``topk`` keeps.
        decay: what share of the residual is carried into the next encode, in (0, 1].

    Raises:
        ValueError: naming the setting that is wrong.
    """

    codec: str
    block_size: int = 256
    stochastic: bool = False
    pin_memory: bool = False
    k: int = 0
    bits: int = 0
    decay: float = 1.0

    def __post_init__(self) -> None:
        check_settings(
            self.codec,
            block_size=self.block_size,
            stochastic=self.stochastic,
            k=self.k,
            bits=self.bits,
        )
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def build(self, generator: torch.Generator | None = None) -> ErrorFeedback:
        """An error feedback with these settings, its rounding noise from ``generator``."""
        return ErrorFeedback(self, generator)


class ErrorFeedback:
    """Carries the quantization residual into the next encode.

    Error feedback (Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019
    EF-SGD): each call encodes ``x + residual`` and keeps what the codec lost, so
    the sum of decoded tensors tracks the sum of inputs to within one residual
    instead of drifting by one quantization error per round. With ``topk`` the
    residual holds every value not sent; with ``decay < 1`` it is SparseLoCo's
    accumulator (Sarfi et al., 2025): ``decay * residual + x`` is encoded, so the
    residual also plays the part of an outer momentum.

    Build it with :meth:`FeedbackSettings.build`.

    Args:
        settings: the codec and how the residual is kept.
        generator: CPU generator for the rounding noise.

    Attributes:
        residual: flat float32 CPU tensor of the carried error, or ``None``
            before the first encode and after :meth:`reset`.
    """

    def __init__(
        self, settings: FeedbackSettings, generator: torch.Generator | None = None
    ) -> None:
        self.settings = settings
        self.generator = generator
        self.residual: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> Encoded:
        """Encodes ``x + residual`` and stores the new residual.

        Args:
            x: floating-point tensor; it must keep the same numel between resets.

        Returns:
            The encoded tensor.

        Raises:
            ValueError: if the numel changed since the last encode, or as
                :func:`encode` does; the residual is left unchanged then.
        """
        s = self.settings
        flat = as_flat_f32(x)
        if self.residual is None:
            target = flat.clone()
        elif self.residual.numel() != flat.numel():
            raise ValueError(
                f"tensor has {flat.numel()} values but the residual has "
                f"{self.residual.numel()}; call reset() when the shape changes"
            )
        elif s.decay == 1.0:
            target = flat + self.residual
        else:
            target = flat + s.decay * self.residual
        if s.pin_memory and not target.is_pinned():
            target = target.pin_memory()
        enc = encode(
            target,
            s.codec,
            block_size=s.block_size,
            stochastic=s.stochastic,
            generator=self.generator,
            k=s.k,
            bits=s.bits,
        )
        self.residual = target.sub_(decode(enc))
        return enc

    def reset(self) -> None:
        """Drops the carried residual, e.g. after a shape change or a rejoin."""
        self.residual = None
