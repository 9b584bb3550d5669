"""Split a model's parameters into fragments that are synchronised one at a time.

The plan depends only on parameter names and shapes, so every node running the same
model computes the same plan. Tensors are assigned whole, largest first, to the
fragment with the fewest elements so far (LPT scheduling, ties broken by order), which
keeps fragments balanced by element count. Within a fragment tensors keep the model's
order, and a fragment travels as one flat float32 vector.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Fragment", "FragmentPlan", "plan_fragments"]


@dataclass(frozen=True)
class Fragment:
    """One fragment: which named tensors it holds, in order."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


@dataclass(frozen=True)
class FragmentPlan:
    """The fragments of one model, plus a digest every node can compare."""

    fragments: tuple[Fragment, ...]

    def __len__(self) -> int:
        return len(self.fragments)

    def __getitem__(self, index: int) -> Fragment:
        return self.fragments[index]

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    def digest(self) -> str:
        """Hex sha256 over every fragment's names and shapes."""
        h = hashlib.sha256()
        for frag in self.fragments:
            h.update(f"#{frag.index}".encode())
            for name, shape in zip(frag.names, frag.shapes):
                h.update(f"{name}:{','.join(map(str, shape))};".encode())
        return h.hexdigest()

    def owners(self, names: Sequence[str]) -> list[int]:
        """The fragment of each of ``names`` (a model's parameter names, in its order);
        -1 for a name no fragment holds (a frozen parameter)."""
        where = {n: frag.index for frag in self.fragments for n in frag.names}
        return [where.get(n, -1) for n in names]

    def flatten(self, params: Mapping[str, torch.Tensor], index: int) -> torch.Tensor:
        """Copy fragment ``index`` out of ``params`` as one flat float32 CPU vector."""
        frag = self.fragments[index]
        return torch.cat([params[n].detach().reshape(-1).float().cpu() for n in frag.names])

    def views(self, vector: torch.Tensor, index: int) -> dict[str, torch.Tensor]:
        """The tensors of fragment ``index`` as views into its flat ``vector`` (no copy)."""
        frag = self.fragments[index]
        out, offset = {}, 0
        for name, shape in zip(frag.names, frag.shapes):
            n = _numel(shape)
            out[name] = vector[offset : offset + n].view(shape)
            offset += n
        return out

    def write(self, params: Mapping[str, torch.Tensor], index: int, vector: torch.Tensor) -> None:
        """Write a flat vector back into the tensors of fragment ``index``, in place.

        Raises:
            ValueError: the vector's length does not match the fragment.
        """
        frag = self.fragments[index]
        if vector.dim() != 1 or vector.numel() != frag.numel:
            raise ValueError(
                f"fragment {index} holds {frag.numel} values, got a vector of shape "
                f"{tuple(vector.shape)}"
            )
        offset = 0
        with torch.no_grad():
            for name in frag.names:
                target = params[name]
                n = target.numel()
                chunk = vector[offset : offset + n].view(target.shape)
                target.copy_(chunk.to(device=target.device, dtype=target.dtype))
                offset += n


def plan_fragments(
    named: nn.Module | Iterable[tuple[str, torch.Tensor | torch.Size | tuple[int, ...]]],
    count: int,
) -> FragmentPlan:
    """Plan ``count`` fragments over a model's trainable parameters (or named shapes).

    Raises:
        ValueError: ``count`` is below 1 or above the number of parameter tensors.
    """
    if isinstance(named, nn.Module):
        items = [(n, tuple(p.shape)) for n, p in named.named_parameters() if p.requires_grad]
    else:
        items = [(n, tuple(s.shape) if isinstance(s, torch.Tensor) else tuple(s)) for n, s in named]
    if count < 1:
        raise ValueError(f"fragment count must be >= 1, got {count}")
    if count > len(items):
        raise ValueError(
            f"sync.fragments = {count} exceeds the model's {len(items)} parameter tensors"
        )
    sizes = [_numel(shape) for _, shape in items]
    order = sorted(range(len(items)), key=lambda i: (-sizes[i], i))
    loads = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        target = min(range(count), key=lambda f: (loads[f], f))
        loads[target] += sizes[i]
        members[target].append(i)
    fragments = []
    for f, idx in enumerate(members):
        idx.sort()
        fragments.append(
            Fragment(
                index=f,
                names=tuple(items[i][0] for i in idx),
                shapes=tuple(items[i][1] for i in idx),
            )
        )
    return FragmentPlan(fragments=tuple(fragments))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
