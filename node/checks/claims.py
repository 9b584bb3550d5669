"""What a node's pseudo-gradients were trained on, claimed with each of them.

From the moment its round-``r`` syncs start, a node trains the batches of round
``r + 1``'s *assigned* stream (:func:`node.data.corpus.assigned_stream`), every rank of a site
its own. :class:`WorkLog` counts the draws taken from the current stream and keeps, per
fragment, the spans trained since that fragment's last sync; a sync takes them as its
:class:`~protocol.averaging.contributions.WorkClaim`, signed into its parts, so a checker
can draw any of those batches again (:mod:`node.checks`).

A skipped sync leaves its spans to the next one, as it leaves its work in the local copy;
so does a sync that was launched but never applied (it failed, or was dropped when the
node fell behind): its claim's spans stay in the fragment's next claim until a sync is
applied (:meth:`WorkLog.settled`). A claim then names every batch whose work its
pseudo-gradient holds, which the sent check relies on (:mod:`verification.binding`).
"""

from __future__ import annotations

from protocol.averaging.contributions import WorkClaim

__all__ = ["MAX_SPANS", "WorkLog"]

MAX_SPANS = 32
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
        self._taken: list[list[list[int]]] = [[] for _ in range(fragments)]
        """Each fragment's spans claimed by a sync not applied yet."""

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
                del spans[:-MAX_SPANS]
        self.position += draws

    def forget(self) -> None:
        """Drop every fragment's claim so far (the work it covers was dropped)."""
        self._spans = [[] for _ in self._spans]
        self._taken = [[] for _ in self._taken]

    def open_spans(self) -> list[tuple[int, int, int]]:
        """Every span no applied sync claimed yet, of any fragment (what a claim to come
        may name)."""
        every = [*self._spans, *self._taken]
        return [(s[0], s[1], s[2]) for spans in every for s in spans]

    def take(self, fragment: int) -> WorkClaim | None:
        """The claim of ``fragment``'s sync now (None when it trained nothing assigned):
        the spans since the last applied sync of ``fragment``; new spans start over."""
        spans = _joined(self._taken[fragment], self._spans[fragment])[-MAX_SPANS:]
        self._taken[fragment], self._spans[fragment] = spans, []
        if not spans:
            return None
        return WorkClaim(
            tuple((s[0], s[1], s[2]) for s in spans), self.ranks, self.slice, self.batch
        )

    def settled(self, fragment: int) -> None:
        """``fragment``'s last launched sync was applied: its claim's work is in the
        global copy, and the next claim starts after it."""
        self._taken[fragment] = []


def _joined(before: list[list[int]], after: list[list[int]]) -> list[list[int]]:
    """``before`` then ``after``, a span that continues the one before merged into it."""
    out = [list(s) for s in before]
    for s in after:
        last = out[-1] if out else None
        if last is not None and last[0] == s[0] and last[1] + last[2] == s[1]:
            last[2] += s[2]
        else:
            out.append(list(s))
    return out
