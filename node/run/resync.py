"""Catching up: taking a newer global state from peers (a joiner, a node that fell
behind), taking the swarm's state after a round that went wrong, and staying reachable
after the last round while a peer is still behind.

After a round that went wrong every node takes the same state
(:func:`node.train.agreement.swarm_state` of the digests peers signed), so two nodes that
both lost a sync never wait on each other (``docs/agreement.md``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from node.run.state import Running
from node.train.agreement import swarm_state
from protocol import catchup
from protocol.errors import ProtocolError

__all__ = ["Resync", "ResyncSettings"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResyncSettings:
    """What catching up reads from the configuration (in
    :class:`~node.run.rounds.RoundSettings`).

    Attributes:
        run_id: the run whose signed states are read.
        catchup: how a state is downloaded.
        state_signers: how many peers must sign a state before it is taken (fewer
            when fewer are live).
        request_timeout: one request's timeout.
        round_timeout: the longest a round's signed states are waited for.
        matchmaking_seconds: an exchange's matchmaking wait (how long a peer's last
            sync may take, with the round timeout).
    """

    run_id: str
    catchup: catchup.CatchUpSettings
    state_signers: int
    request_timeout: float
    round_timeout: float
    matchmaking_seconds: float


class Resync:
    """Takes the swarm's state for a node.

    Args:
        settings: timeouts and signers.
        running: the node's records, its logs and its stop.
    """

    def __init__(self, settings: ResyncSettings, running: Running) -> None:
        self.settings = settings
        self.progress = running.progress
        self.training = running.training
        self.network = running.network
        self.status, self.events = running.status, running.events
        self.stop = running.stop

    def catch_up(
        self,
        min_round: int,
        rebase: bool = False,
        digest: str | None = None,
        holders: list[str] | None = None,
    ) -> bool:
        """Take the newest global state from a live peer at ``min_round`` or later (with
        ``digest``: that state, from ``holders``).

        With ``rebase`` this node's unsynced local work is kept: each fragment's local
        copy moves by the same amount as its global copy, so the work is contributed at
        the next sync instead of being thrown away.
        """
        t, peers = self.training, self.network.peers
        t.site.pull(self.stop.is_set())
        record = self.network.record(self.progress.round, t.trainer.steps)
        timeout = self.settings.request_timeout
        self.network.transport.run(peers.refresh(record), timeout * 2 + 5)
        started = time.monotonic()
        found = catchup.download(
            self.network.transport,
            peers.identity,
            self.settings.catchup,
            peers.sources(min_round) if holders is None else peers.among(holders),
            t.plan,
            min_round=min_round,
            signers=max(1, min(self.settings.state_signers, len(peers.live()))),
            digest=digest,
        )
        if found is None:
            return False
        snap, sources = found
        seconds, size = time.monotonic() - started, snap.nbytes
        before = [t.outer.global_vector(f) for f in range(len(t.plan))]
        if self.network.tracer is not None:
            self.network.tracer.seal()  # the catch-up is about to change the model
        t.outer.load_snapshot(snap)
        for f in range(len(t.plan)):
            if rebase:
                t.outer.rebase_local(t.model, f, before[f])
            else:
                t.outer.sync_local(t.model, f)
                t.feedback[f].reset()
        self.progress.clock.finish(max(self.progress.round, snap.round))
        t.site.model_changed()
        # Follow the swarm's place in the inner learning-rate schedule: a newcomer at
        # its warmup peak would take steps far larger than everyone else's.
        t.trainer.steps = max(t.trainer.steps, snap.steps)
        progress = self.progress
        progress.catch_ups += 1
        progress.catch_up_bytes += size
        progress.catch_up_seconds += seconds
        self.status.update(
            catch_ups=progress.catch_ups,
            catch_up_bytes=progress.catch_up_bytes,
            catch_up_seconds=round(progress.catch_up_seconds, 2),
        )
        self.events.write(
            "catch_up",
            round=progress.round,
            sources=sources,
            bytes=size,
            seconds=round(seconds, 3),
        )
        return True

    def take_swarm_state(self, r: int, digest: str, joining: bool) -> tuple[str, bool]:
        """After a round that went wrong, take the swarm's state of round ``r`` if it is
        not this node's own (``digest``); return the digest this node holds now, and
        whether its unsynced local work was dropped (a joiner's, see below).

        The node signs its digest as unsettled (or joining), waits until every live peer
        has signed one for the round (at most ``network.round_timeout``, less where the
        node's exchanges showed that its peers answer sooner: :mod:`node.train.deadlines`), and
        takes :func:`node.train.agreement.swarm_state` of the signatures: every node that lost
        a sync picks the same state, so none waits on another that is re-syncing too.
        """
        s, transport = self.settings, self.network.transport
        server = self.network.state_server
        standing = "joining" if joining else "unsettled"
        attesting = server.attest(r, digest, timeout=s.request_timeout, standing=standing)
        transport.run(attesting, s.request_timeout + 5)
        deadline = time.monotonic() + self.network.deadlines.state_wait(s.round_timeout)
        signed = self._signatures(r, deadline)
        target = swarm_state(signed)
        if target is None or target == digest:
            logger.info("round %d: this node's state is the swarm's", r)
            return digest, False
        holders = sorted(p for p, s in signed[target].items() if s != "joining")
        while not self.stop.is_set():
            # A node that sat the round out joining drops what it trained meanwhile: kept,
            # its first contribution would carry that round's work too and fail the norm
            # screens of the peers it joins.
            if self.catch_up(min_round=r, rebase=not joining, digest=target, holders=holders):
                logger.warning("round %d: took the swarm's state from a peer", r)
                return server.publish(self.training.snapshot(self.progress.round)), joining
            if time.monotonic() >= deadline:
                break
            self.stop.wait(0.5)
        logger.warning("round %d: could not take the swarm's state from any peer", r)
        return digest, False

    def _signatures(self, r: int, deadline: float) -> dict[str, dict[str, str]]:
        """The digests signed for round ``r``, once every live peer signed or at
        ``deadline``: ``{digest: {signer: standing}}``."""
        timeout, transport = self.settings.request_timeout, self.network.transport
        signed: dict[str, dict[str, str]] = {}
        while not self.stop.is_set():
            expected = self.network.live_peers() | self.network.heard()
            reading = catchup.attested(transport, self.settings.run_id, r, timeout=timeout)
            try:
                signed = transport.run(reading, timeout + 5)
            except (ProtocolError, TimeoutError) as exc:
                logger.info("round %d: signed states unreadable: %s", r, exc)
            signers = {p for who in signed.values() for p in who}
            if expected <= signers or time.monotonic() >= deadline:
                break
            self.stop.wait(0.5)
        return signed

    def linger(self) -> None:
        """After the last round, stay reachable while a live peer is still behind
        (bounded by how long its last sync may take): a peer whose last sync failed
        re-syncs from the swarm's state, and it can only take it from running nodes. Not
        for a peer this node holds in quarantine or a ban: waiting on a faulty peer
        would cost the node's operator its time."""
        s, network, progress = self.settings, self.network, self.progress
        # as long as a lagging peer's last sync can take, and no longer
        deadline = time.monotonic() + s.matchmaking_seconds + 3 * s.round_timeout
        self.status.update(force=True, state="lingering", round=progress.round)
        # Say at once that this node finished: a peer that lingers for it would otherwise
        # wait until its record of the round before went stale (network.registry_seconds
        # may not come round again before this node exits).
        record = network.record(progress.round, self.training.trainer.steps)
        try:
            network.transport.run(network.peers.publish(record), s.request_timeout)
        except (TimeoutError, RuntimeError) as exc:
            logger.debug("final registry record not written: %s", exc)
        while time.monotonic() < deadline and not self.stop.is_set():
            flagged = network.verifier.flagged(progress.round)
            if not [p for p in network.peers.behind(progress.round) if p not in flagged]:
                return
            self.stop.wait(0.5)
