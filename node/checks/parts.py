"""What the node hands its useful-work checks, grouped once (``node/build.py``): the
collaborators the checks work with (:class:`CheckParts`) and the node's hooks they
report through (:class:`CheckHooks`). The worker (:mod:`node.checks.work`) passes them
on to its pieces: this node's own checks (:mod:`node.checks.own`), the record ledger
(:mod:`node.checks.records`) and the replay checks (:mod:`node.checks.replays`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from node.checks.fetch import Fetcher
from node.checks.measure import Measurer
from node.checks.replay import Replayer
from node.checks.trace import Tracer
from verification.identity import Identity
from verification.verifier import Verifier

__all__ = ["CheckHooks", "CheckParts"]


@dataclass(frozen=True)
class CheckParts:
    """The checks' collaborators.

    Attributes:
        identity: this node's key (signs records).
        verifier: where violations go; its ``work`` scores take the records.
        measurer: measures contributions on a round's base.
        fetcher: fetches contributions, traces and start states.
        replayer: replays windows of checked members' traces (``trust.replay_steps``;
            None: no replay checks).
        tracer: this node's own trace (None: not traced): told, once a round's seed is
            known, which windows its checkers replay (:meth:`Tracer.drawn`); its time
            (:meth:`Tracer.spent`) counts in the checks' budget.
    """

    identity: Identity
    verifier: Verifier
    measurer: Measurer
    fetcher: Fetcher
    replayer: Replayer | None = None
    tracer: Tracer | None = None


@dataclass(frozen=True)
class CheckHooks:
    """The node's side of the checks.

    Attributes:
        publish: gossips a signed record on the control channel's ``check`` topic.
        events: the node's event log writer.
        training_seconds: the time the node spent in inner steps so far (the budget's
            measure).
    """

    publish: Callable[[bytes], bool]
    events: Callable[..., None]
    training_seconds: Callable[[], float]
