"""The three hooks a node plugs into its all-reduce, each neutral by default.

* :class:`Judge`: trust decisions: who is refused and what a refusal costs, what a
  missing part or a refused result says about its sender, and whether a result is
  plausible (accepts everything by default);
* :class:`Commitments`: the commit phase (none by default: parts are sent at once);
* :class:`FaultInjection`: how this node acts (honestly by default; ``atoll run
  --byzantine`` for tests and benchmarks). It only transforms what the honest code signs
  and commits: the member signs its parts itself
  (:func:`~protocol.averaging.sealing.seal_with`, :func:`~protocol.averaging.sealing.seal_for`).

Protocol code only calls down into these; the node supplies its verifier, its control
plane's commitment store and its fault mode, with its reducer and planner, in one
:class:`Hooks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from protocol.averaging.parts import Planner, Reducer, weighted_mean_plan, weighted_mean_reducer
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart

__all__ = ["Commitments", "FaultInjection", "Hooks", "Judge"]


class Judge:
    """The trust decisions an all-reduce asks for; the default accepts everything.

    The node's :class:`~verification.verifier.Verifier` has its shape (the all-reduce
    calls it directly, as it calls the reducer on plain records): who is refused, what a
    refusal costs the peer, and whether an owner's result is plausible.
    """

    def refusal(self, peer: str, round_: int) -> str | None:
        """Why this node, as an owner, leaves ``peer``'s part out of its result at
        ``round_``; None admits it. The part is still taken and the result still
        returned to the peer, so every member of a part gets the one result."""
        return None

    def listed(self, peer: str, round_: int) -> str | None:
        """Why the operator's lists refuse ``peer``: all a gather refuses a member for
        (its members must reduce the same parts; standing acts through votes)."""
        return None

    def blocks(self, peer: str, round_: int) -> str | None:
        """Why this node does not deal with ``peer`` at all (refuses its messages and
        its results): the operator's own lists, or proof of misbehaviour; None talks."""
        return None

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        """A message from the authenticated ``peer`` was refused before aggregation."""

    def on_missing(self, peer: str, round_: int, fragment: int, part: int, committed: bool) -> None:
        """``peer``'s part never reached this owner by its deadline (``committed``: after
        the peer signed a commitment to send it)."""

    def on_owner_refused(
        self, owner: str, round_: int, fragment: int, part: int, reason: str
    ) -> None:
        """This node refused ``owner``'s reduced part (it keeps its own values there)."""

    def check_reduced(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reduced: torch.Tensor,
        own: torch.Tensor,
        spread: float = 1.0,
        included: bool = True,
        reduced_norm: float | None = None,
        content: str = "update",
    ) -> str | None:
        """Judge a reduced part against this node's own contribution; a reason refuses it.
        ``included`` is False when the owner left this node's part out (with a reason);
        ``reduced_norm`` is the result's norm when decoding computed it; ``content`` says
        what was averaged.

        ``spread`` is the largest contributor weight over this node's own (at least 1):
        a node that trained less than its peers sees a larger average than its own.
        """
        return None


class Commitments:
    """The commit phase of an exchange; a service without one skips it.

    Before sending any part, a member publishes the digests of its signed parts for
    ``(round, fragment, content)`` and waits (bounded) for its group's commitments. An
    owner takes a part only if its sender committed to exactly that digest before the
    owner's own commit phase closed, so no member can shape its part after seeing
    the others'.
    """

    async def commit(
        self,
        round_: int,
        fragment: int,
        group: Sequence[str],
        digests: dict[int, bytes],
        content: str = "update",
    ) -> None:
        """Publish this node's commitment and wait for the group's (bounded)."""

    async def check(
        self,
        peer: str,
        round_: int,
        fragment: int,
        part: int,
        digest: bytes,
        closed_at: float,
        content: str = "update",
    ) -> str | None:
        """Why ``peer``'s part is refused: ``uncommitted``, ``late_commit`` or
        ``commit_mismatch`` (None: committed in time). ``closed_at`` is this owner's
        ``time.monotonic()`` when its commit phase closed."""
        return None

    def committed(self, peer: str, round_: int, fragment: int, content: str = "update") -> bool:
        """Whether ``peer`` signed a commitment for ``(round, fragment, content)``: a
        member that committed and then delivered nothing broke a promise it signed."""
        return False

    def evidence(self, peer: str, round_: int, fragment: int, content: str = "update") -> bytes:
        """``peer``'s signed commitment for ``(round, fragment, content)`` as this node
        holds it (empty when none). An owner puts its contributors' commitments into its
        signed result: what it relied on, so a contributor that signed another
        commitment cannot pass it off as proof that the owner misstated its input."""
        return b""

    def check_result(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reply: bytes,
        contributors: Sequence[str],
        digests: Sequence[bytes],
        content: str = "update",
    ) -> str | None:
        """Why an owner's signed result is refused: ``bad_owner`` when it names, for a
        contributor, a digest other than the one that contributor committed to."""
        return None

    def convict_owner(
        self, owner: str, round_: int, fragment: int, reply: bytes, content: str = "update"
    ) -> None:
        """Act on a result :meth:`check_result` found ``bad_owner``: ``reply`` (its
        evidence) proves that ``owner`` misstated this node's committed input."""


class FaultInjection:
    """How this node acts in an all-reduce: honestly, unless a fault is injected.

    ``atoll run --byzantine MODE`` (tests and benchmarks) overrides these hooks. Each one
    only transforms what the honest code hands it and returns it unchanged by default:
    the member signs its parts (:func:`~protocol.averaging.sealing.seal_with`) and
    commits to their digests itself, and the owner signs its result itself.
    """

    def contribution(self, round_: int, fragment: int, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def part(self, meta: dict, encoded: codecs.Encoded) -> tuple[dict, codecs.Encoded]:
        """A part's fields and values before they are signed."""
        return meta, encoded

    def sealed(self, header: Header, meta: dict, sealed: SealedPart) -> SealedPart:
        """A signed part as it goes on the wire."""
        return sealed

    def sent_to(self, j: int, header: Header, meta: dict) -> dict:
        """In a gather, the fields of the one part as signed for member ``j`` (the same
        ``meta`` object: the one part everyone gets)."""
        return meta

    commit_delay: float = 0.0
    """Seconds to wait before committing."""

    def commits(
        self, group: Sequence[str], digests: dict[int, bytes]
    ) -> list[tuple[Sequence[str], dict[int, bytes]]]:
        """The commitments made, in order, as ``(group waited for, digests)``."""
        return [(group, digests)]

    def reduced_meta(self, meta: dict) -> dict:
        return meta

    def reduced(self, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def reply(self, sealed: SealedPart) -> SealedPart:
        """The signed result as it goes on the wire."""
        return sealed

    def trailer(self, frame: bytes) -> bytes:
        """The trailer of a result streamed back, as it goes on the wire."""
        return frame

    silent: bool = False
    """Announce and commit, then send no part and answer no one (a silent member)."""

    def silent_in(self, round_: int, fragment: int) -> bool:
        """Whether to go quiet in the exchange of ``round_`` and ``fragment``."""
        return self.silent

    stream_results: bool = True
    """As an owner, stream its result back while reducing (when settings allow it)."""


@dataclass(frozen=True)
class Hooks:
    """What a node plugs into its all-reduce, each neutral by default.

    Attributes:
        reducer: how an owner combines contributions (the token-weighted mean).
        planner: how ``reducer`` reduces block by block while parts arrive
            (:data:`~protocol.averaging.parts.Planner`); None: the weighted mean's own
            for the default reducer, and none for any other (it reduces once all are in).
        judge: trust decisions (accepts everything).
        commitments: the commit phase (none: parts are sent at once).
        faults: how this node acts (honestly).
    """

    reducer: Reducer = weighted_mean_reducer
    planner: Planner | None = None
    judge: Judge = field(default_factory=lambda: Judge())
    commitments: Commitments | None = None
    faults: FaultInjection = field(default_factory=lambda: FaultInjection())

    def stream_planner(self) -> Planner | None:
        """The planner the owners reduce with while parts arrive (with ``stream_reduce``)."""
        if self.planner is None and self.reducer is weighted_mean_reducer:
            return weighted_mean_plan
        return self.planner
