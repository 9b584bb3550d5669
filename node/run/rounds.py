"""A round's end, and the node's state between rounds: resuming from a checkpoint,
publishing and attesting the global state, evaluating it and checkpointing it. Taking
a peer's or the swarm's state is :mod:`node.run.resync`'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config_training import TrainConfig
from node.run.load import memory_per_param
from node.run.resync import Resync, ResyncSettings
from node.run.state import Running
from node.train.agreement import AgreementWatch
from node.train.checkpoint import load_latest, save_checkpoint
from node.train.trainer import make_inner_optimizer
from protocol import catchup

__all__ = ["RoundSettings", "Rounds"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundSettings:
    """What a round's end reads from the configuration, built by
    :func:`node.settings.round_settings`.

    Attributes:
        run_id: the run (in each checkpoint).
        checkpoints: the folder of the node's checkpoints.
        checkpoint_every: rounds between two checkpoints.
        keep_checkpoints: how many are kept.
        eval_every: rounds between two evaluations of the global state.
        train: the inner optimizer's settings (a fresh one where a checkpoint holds
            another's state).
        resync: how the node takes its peers' state.
    """

    run_id: str
    checkpoints: Path
    checkpoint_every: int
    keep_checkpoints: int
    eval_every: int
    train: TrainConfig
    resync: ResyncSettings

    def build(self, running: Running, agreement: AgreementWatch) -> Rounds:
        """The round's end of the node that ``running`` describes."""
        return Rounds(self, running, agreement)


class Rounds:
    """What happens between two rounds of training (built by :meth:`RoundSettings.build`).

    Args:
        settings: checkpoints, evaluation and catching up.
        running: the node's records, its logs and its stop.
        agreement: this node's global digest against its peers'.
    """

    def __init__(
        self, settings: RoundSettings, running: Running, agreement: AgreementWatch
    ) -> None:
        self.settings = settings
        self.progress = running.progress
        self.training = running.training
        self.network = running.network
        self.status, self.events = running.status, running.events
        self.stop = running.stop
        self.agreement = agreement
        self.resync = Resync(settings.resync, running)
        """Catching up from peers, and taking the swarm's state after a round gone wrong."""

    def pull(self) -> None:
        """Under FSDP, before the model is read: the full values of the shards."""
        self.training.site.pull(self.stop.is_set())

    # ---- between rounds ---------------------------------------------------------------

    def resume(self) -> None:
        """Resume from the newest valid checkpoint, if there is one."""
        found = load_latest(self.settings.checkpoints)
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
                t.trainer.optimizer = make_inner_optimizer(t.trainer.model, self.settings.train)
        t.trainer.steps, t.trainer.tokens = state["steps"], state["tokens"]
        if self.network is not None and self.network.tracer is not None:
            # no trace holds the unsynced work of the run before: a claim could not name
            # it, and the sent check would fail on it (verification/binding.py)
            for f in range(len(t.plan)):
                t.outer.sync_local(t.model, f)
        self.progress.clock.finish(state["round"])
        logger.info("resumed from %s (round %d)", info.path.name, self.progress.round)
        self.events.write("resume", round=self.progress.round, checkpoint=info.path.name)

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
        server, timeout = self.network.state_server, self.settings.resync.request_timeout
        self.network.transport.submit(server.attest(r, digest, timeout=timeout))
        fields = self._report(r, digest)
        if r % self.settings.checkpoint_every == 0:
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
            digest, dropped = self.resync.take_swarm_state(r, digest, joining=joining)
            return digest, resync, dropped
        return digest, resync, False

    def _report(self, r: int, digest: str) -> dict[str, Any]:
        """The round event's fields (evaluating the global state when due)."""
        t, network = self.training, self.network
        fields: dict[str, Any] = {"round": r, "global_digest": digest}
        if r % self.settings.eval_every == 0:
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
        return self.training.snapshot(self.progress.round)

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
            "run_id": self.settings.run_id,
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
        keep = self.settings.keep_checkpoints
        info = save_checkpoint(self.settings.checkpoints, p.round, state, keep=keep)
        p.checkpoint_time = time.time()
        self.events.write("checkpoint", round=p.round, file=info.path.name, digest=info.digest)
