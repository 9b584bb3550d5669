"""A round's end, and the node's state between rounds: resuming from a checkpoint,
catching up from peers, taking the swarm's state after a round that went wrong,
publishing and attesting the global state, evaluating it and checkpointing it.

After a round that went wrong every node takes the same state
(:func:`node.train.agreement.swarm_state` of the digests peers signed), so two nodes that
both lost a sync never wait on each other (``docs/agreement.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from node.config import AtollConfig
from node.run.load import memory_per_param
from node.run.metrics import EventLog, StatusWriter
from node.run.state import Network, Progress, Training
from node.settings import catchup_settings
from node.train.agreement import AgreementWatch, swarm_state
from node.train.checkpoint import load_latest, save_checkpoint
from node.train.trainer import make_inner_optimizer
from protocol import catchup
from protocol.errors import ProtocolError

__all__ = ["Rounds"]

logger = logging.getLogger(__name__)


class Rounds:
    """What happens between two rounds of training.

    Args:
        cfg: the node's configuration.
        progress: where the training stands (its round moves here).
        training: the model, its optimizers and the site.
        network: the swarm side.
        logs: the status file and the event log.
        agreement: this node's global digest against its peers'.
        stop: set when the node is stopping.
        data_dir: the node's data directory (checkpoints).
    """

    def __init__(
        self,
        cfg: AtollConfig,
        progress: Progress,
        training: Training,
        network: Network,
        logs: tuple[StatusWriter, EventLog],
        agreement: AgreementWatch,
        stop: threading.Event,
        data_dir: Path,
    ) -> None:
        self.cfg = cfg
        self.progress = progress
        self.training = training
        self.network = network
        self.status, self.events = logs
        self.agreement = agreement
        self.stop = stop
        self.checkpoints = data_dir / "checkpoints"

    def pull(self) -> None:
        """Under FSDP, before the model is read: the full values of the shards."""
        self.training.site.pull(self.stop.is_set())

    # ---- between rounds ---------------------------------------------------------------

    def resume(self) -> None:
        """Resume from the newest valid checkpoint, if there is one."""
        found = load_latest(self.checkpoints)
        if found is None:
            return
        info, state = found
        t = self.training
        if state.get("plan") != t.plan.digest():
            raise ValueError(f"checkpoint {info.path} is for another model or fragment plan")
        t.model.load_state_dict(state["model"])
        t.outer.load_state_dict(state["outer"])
        if state.get("inner") is not None and not t.site.sharded:
            try:
                t.trainer.optimizer.load_state_dict(state["inner"])
            except (ValueError, KeyError) as exc:
                # the inner optimizer is this node's own: a fresh one only costs warmup
                logger.warning(
                    "%s holds the state of another inner optimizer (train.optimizer "
                    "changed?): starting a fresh one (%s)",
                    info.path.name,
                    exc,
                )
                t.trainer.optimizer = make_inner_optimizer(t.trainer.model, self.cfg.train)
        t.trainer.steps, t.trainer.tokens = state["steps"], state["tokens"]
        if self.network is not None and self.network.tracer is not None:
            # no trace holds the unsynced work of the run before: a claim could not name
            # it, and the sent check would fail on it (verification/binding.py)
            for f in range(len(t.plan)):
                t.outer.sync_local(t.model, f)
        self.progress.clock.finish(state["round"])
        logger.info("resumed from %s (round %d)", info.path.name, self.progress.round)
        self.events.write("resume", round=self.progress.round, checkpoint=info.path.name)

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
        net, t, peers = self.cfg.network, self.training, self.network.peers
        self.pull()
        record = self.network.record(self.progress.round, t.trainer.steps)
        self.network.transport.run(peers.refresh(record), net.request_timeout * 2 + 5)
        started = time.monotonic()
        found = catchup.download(
            self.network.transport,
            peers.identity,
            catchup_settings(self.cfg),
            peers.sources(min_round) if holders is None else peers.among(holders),
            t.plan,
            min_round=min_round,
            signers=max(1, min(self.cfg.trust.state_signers, len(peers.live()))),
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
        net, transport = self.cfg.network, self.network.transport
        server = self.network.state_server
        standing = "joining" if joining else "unsettled"
        attesting = server.attest(r, digest, timeout=net.request_timeout, standing=standing)
        transport.run(attesting, net.request_timeout + 5)
        deadline = time.monotonic() + self.network.deadlines.state_wait(net.round_timeout)
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
                return server.publish(self.snapshot()), joining
            if time.monotonic() >= deadline:
                break
            self.stop.wait(0.5)
        logger.warning("round %d: could not take the swarm's state from any peer", r)
        return digest, False

    def _signatures(self, r: int, deadline: float) -> dict[str, dict[str, str]]:
        """The digests signed for round ``r``, once every live peer signed or at
        ``deadline``: ``{digest: {signer: standing}}``."""
        net, transport = self.cfg.network, self.network.transport
        signed: dict[str, dict[str, str]] = {}
        while not self.stop.is_set():
            expected = self.network.live_peers() | self.network.heard()
            reading = catchup.attested(
                transport, self.cfg.run.run_id, r, timeout=net.request_timeout
            )
            try:
                signed = transport.run(reading, net.request_timeout + 5)
            except (ProtocolError, TimeoutError) as exc:
                logger.info("round %d: signed states unreadable: %s", r, exc)
            signers = {p for who in signed.values() for p in who}
            if expected <= signers or time.monotonic() >= deadline:
                break
            self.stop.wait(0.5)
        return signed

    # ---- a round's end ----------------------------------------------------------------

    def end(self, r: int, resync: bool, joining: bool) -> bool:
        """Round ``r`` is over: settle the global state (taking the swarm's if a sync
        of the round went wrong, or this node's digest is apart from its peers'),
        publish and attest it, evaluate, checkpoint and report.

        Args:
            resync: a sync of the round failed or was skipped.
            joining: the node sat the round out, joining the swarm.

        Returns:
            Whether the node's unsynced local work was dropped: a joiner that took the
            swarm's state starts its first contribution from it.
        """
        self.progress.clock.finish(r)
        self.pull()
        digest, went_wrong, dropped = self._settle(r, resync, joining)
        checks = self.network.checks
        if checks is not None:
            checks.round_ended(r, went_wrong)
        self.progress.global_digest = (r, digest)
        self.agreement.own(r, digest)
        server, timeout = self.network.state_server, self.cfg.network.request_timeout
        self.network.transport.submit(server.attest(r, digest, timeout=timeout))
        fields = self._report(r, digest)
        if r % self.cfg.run.checkpoint_every == 0:
            self.checkpoint()  # before the status says the round is done
        self.events.write("round", **fields)
        self.status.update(force=True, **fields)
        logger.info(
            "round %d done: val_bpb %s, %d bytes sent",
            r,
            f"{fields['val_bpb']:.3f}" if "val_bpb" in fields else "-",
            self.progress.bytes_sent,
        )
        return dropped

    def _settle(self, r: int, resync: bool, joining: bool) -> tuple[str, bool, bool]:
        """Publish this node's state of round ``r`` and take the swarm's where it must;
        the digest it holds then, whether the round went wrong here, and whether its
        local work was dropped."""
        network = self.network
        mixing = network.exchange.settings.mixes(len(network.live_peers()) + 1)
        apart = None if mixing else self.agreement.check(r)
        if apart is not None:
            logger.warning("round %d: %s: taking the swarm's state", r, apart)
            resync = True
        digest = network.state_server.publish(self.snapshot())
        if resync and mixing:
            # Global copies differ across the swarm by design: there is no one state to
            # take; the next rounds' mixing pulls this node's copy back in.
            logger.info("round %d: no re-sync while groups mix weights", r)
        elif resync and (network.live_peers() or network.heard()):
            digest, dropped = self.take_swarm_state(r, digest, joining=joining)
            return digest, resync, dropped
        return digest, resync, False

    def _report(self, r: int, digest: str) -> dict[str, Any]:
        """The round event's fields (evaluating the global state when due)."""
        t, network = self.training, self.network
        fields: dict[str, Any] = {"round": r, "global_digest": digest}
        if r % self.cfg.run.eval_every == 0:
            fields["val_bpb"] = t.evaluate_global()
        fields.update(
            tokens=t.trainer.tokens, steps=t.trainer.steps, bytes_sent=self.progress.bytes_sent
        )
        if network.checks is not None:
            fields["checks"] = network.checks.summary()
        if network.tracer is not None:
            fields["trace"] = network.tracer.summary()
        fields["flagged"] = network.verifier.flagged(r)
        fields["live_peers"] = len(network.live_peers())
        fields["deadlines"] = network.deadlines.summary()
        fields["load"] = network.load.sample()
        fields.update(memory_per_param(t.plan.numel, t.device))
        ranks = t.site.agree()
        if ranks is not None:
            count, same = ranks
            fields.update(ranks=count, ranks_agree=same)
            if not same:
                logger.error("round %d: the ranks of this site hold different parameters", r)
        return fields

    def snapshot(self) -> catchup.StateSnapshot:
        """The global state to serve to peers (the live tensors: publishing copies them
        into its replies before anything steps)."""
        t = self.training
        return t.outer.snapshot(
            self.progress.round, t.plan.digest(), t.trainer.steps, copy_tensors=False
        )

    def checkpoint(self) -> None:
        """Write this round's checkpoint (once a round)."""
        p, t = self.progress, self.training
        if p.checkpointed_round == p.round:
            return
        p.checkpointed_round = p.round
        self.pull()
        # the audit rows and standings of the rounds in the checkpoint go to disk first
        if not self.network.verifier.flush():
            logger.warning("audit log: queued rows not written within 30 s of a checkpoint")
        signed = p.global_digest or (None, "")
        state = {
            "round": p.round,
            "run_id": self.cfg.run.run_id,
            # the digest of this round's global state, as peers attest it (atoll export)
            "global_digest": signed[1] if signed[0] == p.round else "",
            "plan": t.plan.digest(),
            "layout": [[list(f.names), [list(s) for s in f.shapes]] for f in t.plan.fragments],
            "model": t.model.state_dict(),
            # written before anything steps again: the live tensors, not a second copy
            "outer": t.outer.state_dict(copy_tensors=False),
            # under FSDP each rank holds the state of its own shard: not kept
            "inner": None if t.site.sharded else t.trainer.optimizer.state_dict(),
            "steps": t.trainer.steps,
            "tokens": t.trainer.tokens,
            "workload": t.workload,
        }
        keep = self.cfg.run.keep_checkpoints
        info = save_checkpoint(self.checkpoints, p.round, state, keep=keep)
        p.checkpoint_time = time.time()
        self.events.write("checkpoint", round=p.round, file=info.path.name, digest=info.digest)
