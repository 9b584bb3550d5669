"""What a node's pseudo-gradients were trained on, claimed with each of them.

From the moment its round-``r`` syncs start, a node trains the batches of round
``r + 1``'s *assigned* stream (:func:`node.data.assigned_stream`), every rank of a site
its own. :class:`WorkLog` counts the draws taken from the current stream and keeps, per
fragment, the spans trained since that fragment's last sync; a sync takes them as its
:class:`~protocol.averaging.contributions.WorkClaim`, signed into its parts, so a checker
can draw any of those batches again (:mod:`node.checks`).

A skipped sync leaves its spans to the next one, as it leaves its work in the local copy.
"""

from __future__ import annotations

from protocol.averaging.contributions import WorkClaim

__all__ = ["WorkLog"]

_MAX_SPANS = 32
"""Spans kept per fragment (the oldest go first: a claim covers the newest work)."""


class WorkLog:
    """The draws of each fragment's next claim.

    Args:
        fragments: fragments in the model.
        ranks: processes that train in step (a site's ranks).
        data_slice: ``(data.site, data.sites)``.
        batch: windows per batch.
    """

    def __init__(
        self, fragments: int, ranks: int = 1, data_slice: tuple[int, int] = (0, 1), batch: int = 1
    ) -> None:
        self.ranks = ranks
        self.slice = data_slice
        self.batch = batch
        self.stream: int | None = None
        """The round whose assigned stream is trained now (None: not an assigned one)."""
        self.position = 0
        """Draws taken from it so far."""
        self._spans: list[list[list[int]]] = [[] for _ in range(fragments)]

    def assign(self, round_: int) -> None:
        """From now on the node trains round ``round_``'s assigned stream, from its start."""
        self.stream, self.position = round_, 0

    def trained(self, draws: int) -> None:
        """``draws`` batches were drawn from the current stream (every rank alike)."""
        if self.stream is None or draws <= 0:
            return
        for spans in self._spans:
            last = spans[-1] if spans else None
            if last is not None and last[0] == self.stream and last[1] + last[2] == self.position:
                last[2] += draws
            else:
                spans.append([self.stream, self.position, draws])
                del spans[:-_MAX_SPANS]
        self.position += draws

    def forget(self) -> None:
        """Drop every fragment's claim so far (the work it covers was dropped)."""
        self._spans = [[] for _ in self._spans]

    def open_spans(self) -> list[tuple[int, int, int]]:
        """Every span not claimed yet, of any fragment (what a claim to come may name)."""
        return [(s[0], s[1], s[2]) for spans in self._spans for s in spans]

    def take(self, fragment: int) -> WorkClaim | None:
        """The claim of ``fragment``'s sync now (None when it trained nothing assigned);
        its spans start over."""
        spans, self._spans[fragment] = self._spans[fragment], []
        if not spans:
            return None
        return WorkClaim(
            tuple((s[0], s[1], s[2]) for s in spans), self.ranks, self.slice, self.batch
        )
