"""A node's work claims: the draws of each assigned stream each fragment's next sync was
trained on, spans merged while contiguous, started over at each applied sync and kept
over a skipped one or one that was never applied."""

from __future__ import annotations

from node.checks.claims import WorkLog
from protocol.averaging.contributions import WorkClaim


def test_each_fragment_claims_the_draws_since_its_last_sync() -> None:
    log = WorkLog(2, ranks=2, data_slice=(1, 3), batch=8)
    assert log.take(0) is None  # nothing trained on an assigned stream yet
    log.trained(5)  # no stream assigned: nothing to claim
    log.assign(3)
    log.trained(2)
    log.trained(2)
    claim = log.take(0)
    assert claim == WorkClaim(((3, 0, 4),), ranks=2, slice=(1, 3), batch=8)
    assert claim.batches == 2 * 4
    log.settled(0)  # the sync was applied
    log.trained(3)
    log.assign(4)  # the next round's stream, from its start
    log.trained(1)
    assert log.take(0) == WorkClaim(((3, 4, 3), (4, 0, 1)), 2, (1, 3), 8)
    # fragment 1 has not synced yet: everything since the start
    assert log.take(1).spans == ((3, 0, 7), (4, 0, 1))
    log.settled(1)
    assert log.take(1) is None


def test_a_sync_never_applied_leaves_its_spans_to_the_next() -> None:
    """Its pseudo-gradient never reached the global copy: the work stays in the local
    copy, so the next claim names it too (the sent check needs every batch named)."""
    log = WorkLog(1)
    log.assign(1)
    log.trained(4)
    assert log.take(0).spans == ((1, 0, 4),)  # launched; it fails
    log.trained(2)
    assert set(log.open_spans()) == {(1, 0, 4), (1, 4, 2)}  # the tracer keeps both
    log.assign(2)
    log.trained(3)
    assert log.take(0).spans == ((1, 0, 6), (2, 0, 3))  # merged where contiguous
    log.settled(0)
    assert log.open_spans() == []
    log.trained(1)
    log.take(0)
    log.forget()  # a joiner's work dropped with the swarm's state: nothing to claim
    assert log.take(0) is None and log.open_spans() == []


def test_a_skipped_sync_leaves_its_spans_to_the_next() -> None:
    log = WorkLog(1)
    log.assign(1)
    log.trained(4)
    # the sync of round 1 is skipped (joining, or the last one still in flight): the
    # work stays in the local copy, and so in the next claim
    log.assign(2)
    log.trained(4)
    assert log.take(0).spans == ((1, 0, 4), (2, 0, 4))


def test_a_claim_keeps_the_newest_spans() -> None:
    log = WorkLog(1)
    for r in range(40):
        log.assign(r)
        log.trained(1)
    spans = log.take(0).spans
    assert len(spans) == 32 and spans[-1] == (39, 0, 1) and spans[0] == (8, 0, 1)
