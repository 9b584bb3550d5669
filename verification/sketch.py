"""Sketches of a model's parameters: 64 numbers that keep a change's size and direction.

Replay checks compare sketches instead of whole models (:mod:`verification.replay`), and
the sent check compares the sketch of a sent pseudo-gradient with the sum of the windows
that trained it (:mod:`verification.binding`). Both need the same sketch on every node of
a run, of a whole model or of one fragment's flat vector.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

__all__ = ["SKETCH_SIZE", "Sketcher"]

SKETCH_SIZE = 64
"""Signed sums a sketch holds (a CountSketch: each parameter adds its value, with a sign,
to one of them, both drawn from the run's seed)."""
_SKETCH_DOMAIN = b"atoll/sketch/v1\0"


class Sketcher:
    """Sketches of a model's parameters, the same on every node of a run.

    Each parameter tensor ``i`` (in the model's order) gets, from the run's seed, a
    random sign for every element; its signed elements are cut into
    :data:`SKETCH_SIZE` runs of consecutive ones (the last run also takes the
    remainder), and a sketch is each run's sum, added over tensors. Linear: the sketch of
    a change is the change of the sketches, and the sketch of a fragment's tensors is
    the same whether they are read from the model or from the fragment's flat vector;
    its size keeps a change's size on average (each sum is a random-sign sum of its
    elements). The signs are drawn once per tensor and kept (4 bytes a parameter); the
    sums are float32 reductions (one pass over the parameters), returned as float64 on
    the CPU.
    """

    def __init__(self, run_id: str, size: int = SKETCH_SIZE) -> None:
        self.run_id = run_id
        self.size = size
        self._signs: dict[tuple[int, int, str], torch.Tensor] = {}

    def _signs_of(self, index: int, t: torch.Tensor) -> torch.Tensor:
        key = (index, t.numel(), str(t.device))
        if key not in self._signs:
            h = hashlib.sha256(_SKETCH_DOMAIN + f"{self.run_id}/{index}/{t.numel()}".encode())
            g = torch.Generator().manual_seed(int.from_bytes(h.digest()[:8], "big") >> 1)
            bits = torch.randint(0, 2, (t.numel(),), generator=g, dtype=torch.int8)
            self._signs[key] = (1 - 2 * bits).to(torch.float32).to(t.device)
        return self._signs[key]

    @torch.no_grad()
    def _sums(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """Tensor ``index``'s signed run sums (float32, on its device)."""
        k = self.size
        x = t.detach().reshape(-1).float()
        signs = self._signs_of(index, t)
        n = x.numel() // k * k
        sums = torch.zeros(k, dtype=torch.float32, device=x.device)
        if n:
            sums += (x[:n].view(k, -1) * signs[:n].view(k, -1)).sum(1)
        if n < x.numel():
            sums[k - 1] += (x[n:] * signs[n:]).sum()
        return sums

    def sketch(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """The sketch of ``tensors`` (a model's parameters, in its order)."""
        return self.pieces(enumerate(tensors))

    def pieces(self, tensors: Iterable[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The sketch of some of a model's tensors, each with its index in the model's
        order (a fragment's tensors, say, as views of its flat vector)."""
        out = torch.zeros(self.size, dtype=torch.float64)
        for i, t in tensors:
            out += self._sums(i, t).double().cpu()
        return out

    def by_fragment(
        self, tensors: Sequence[torch.Tensor], owners: Sequence[int], fragments: int
    ) -> torch.Tensor:
        """Each fragment's sketch (a ``(fragments, size)`` tensor): tensor ``i`` of
        ``tensors`` (a model's parameters, in its order) is in fragment ``owners[i]``
        (none where it is negative). Their sum over fragments is :meth:`sketch` of the
        fragments' tensors."""
        out = torch.zeros(fragments, self.size, dtype=torch.float64)
        for i, t in enumerate(tensors):
            if owners[i] >= 0:
                out[owners[i]] += self._sums(i, t).double().cpu()
        return out
