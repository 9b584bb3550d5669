"""The operator's trust policy: whom to accept, how to aggregate, what a violation costs.

:class:`TrustPolicy` is a frozen pydantic dataclass, so a node config embeds it as
its ``[trust]`` table and every bad value fails at load time with the key named
(``configs/trust/*.toml`` hold ready policies). The policy only decides; the
screening, aggregation and reputation code act on its answers.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

__all__ = ["Aggregator", "TrustPolicy", "is_peer_id"]

Aggregator = Literal[
    "mean", "median", "trimmed_mean", "centered_clip", "clipped_mean", "krum", "multi_krum"
]
"""Aggregator names a policy may choose (those of :mod:`verification.aggregators`)."""

# Base58 (Bitcoin alphabet: no 0, O, I, l). Ed25519 PeerIDs start "12D3KooW" (identity
# multihash, 52 chars); RSA/legacy ones are sha2-256 multihashes starting "Qm" (46 chars).
_PEER_ID = re.compile(r"(12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]+")
_PEER_ID_LEN = (46, 60)


def is_peer_id(text: str) -> bool:
    """Whether ``text`` looks like a base58 libp2p PeerID (shape only, no decoding).

    Args:
        text: candidate PeerID.

    Returns:
        True for a base58 string of 46 to 60 characters starting with ``12D3KooW``
        or ``Qm``.
    """
    return (
        isinstance(text, str)
        and _PEER_ID_LEN[0] <= len(text) <= _PEER_ID_LEN[1]
        and _PEER_ID.fullmatch(text) is not None
    )


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TrustPolicy:
    """An operator's trust policy (the ``[trust]`` table of a node config).

    Attributes:
        allow: PeerIDs always accepted; with ``accept_unknown = false``, the only ones.
        deny: PeerIDs never accepted, whatever else says.
        accept_unknown: whether peers on neither list are accepted.
        aggregator: robust aggregator for received contributions.
        aggregator_params: the aggregator's parameters (``trim`` for
            ``trimmed_mean``, ``tau``/``iters`` for ``centered_clip``, ``f``/``m`` for
            Krum); names and kinds are checked by :func:`verification.aggregators.aggregate`.
        screening: whether contributions are screened (norm, direction, tokens)
            before aggregation; signature and shape checks always run.
        norm_kappa: a contribution whose norm exceeds ``norm_kappa`` times the
            group's median norm is rejected.
        min_cosine: a contribution whose cosine similarity with the group's
            robust direction is below this is rejected.
        max_tokens: cap on the token count a peer may claim for one contribution.
        max_share: maximum share of an aggregate that one peer's weight may carry.
        on_violation: what a screened-out contribution costs its sender.
        outlier_rounds: a vector the statistical screens refuse (``norm``,
            ``direction``, ``owner_norm``, ``owner_direction``) is always left out, but
            counts as a violation only once its sender has failed one in this many
            different rounds within ``outlier_window`` rounds (1, the default: at once).
            2 spares an honest peer one round's bad luck and leaves an attacker that
            owns parts in the groups a round longer (docs/trust.md). The deterministic
            checks (shape, finiteness, tokens, signatures, replays) count at once.
        outlier_window: see ``outlier_rounds``.
        quarantine_rounds: how many rounds a quarantine lasts.
        min_reputation: peers whose score is below this are not grouped with.
        state_signers: a downloaded global state is loaded only when at least this
            many peers (capped by how many are live) signed its digest for its round.
        violations_to_ban: ban a peer once it reaches this many violations, whatever
            ``on_violation`` says; 0 never escalates.
        on_proof: what checked proof of misbehaviour costs (equivocation: two signed
            commitments that differ), whether this node saw it or a verdict carried it.
        max_missed: parts a peer may commit to and not deliver within
            ``missed_window`` rounds before that counts as one violation
            (``no_delivery``); fewer cost nothing, since an honest node can be slow
            or cut off once.
        missed_window: see ``max_missed``.
        checkers: members of an exchange that check each contribution's effect on the
            loss (:mod:`verification.usefulness`); 0 runs no checks. Needs the commit
            phase (a checker compares what it fetches with what was committed).
        check_windows: windows per check, of the contributor's claimed batches (each
            from another batch) and as many of control text.
        check_fragments: fragments of each contributor checked per round (drawn after
            the round; the others go unchecked that round).
        check_from_round: the first round with check records (the first rounds of a
            fresh model learn what any text teaches, so no contribution gains more on its
            own data, and round 2's large gains would outweigh later rounds' in pooled
            ratios); replay and sent checks run from round 1.
        check_min_records: records of a peer needed before it can be flagged (they must
            also span two rounds, :data:`verification.workscores.MIN_ROUNDS`).
        check_min_work: a peer whose pooled work ratio (its gain on control text per
            claimed batch over its rounds' reference gains, :mod:`verification.workscores`)
            is below this even at the upper end of its interval falls short of the work
            it claims.
        check_min_specific: a peer whose pooled specific ratio (its lift on its claimed
            batches beyond control text, over its rounds' reference lifts) is below this
            even at the upper end of its interval falls short too: it did not train on
            them, or not as much as it claims. A peer that falls
            short over ``check_min_records`` records from two checkers or more, with
            any one checker's records left out and with any one round's, is flagged (a
            ``useless_work`` violation where replay and sent checks do not both run;
            where they do, its flag only lowers its weight and a charge needs their
            evidence: :func:`node.settings.check_settings`).
        check_rounds: a peer is judged on its records of its newest this many rounds
            (0: on its newest 24 records, however old), so that its first checked
            rounds, whose gains say least of the work, stop vetoing a flag once
            newer rounds agree.
        check_audit: the share of other checkers' records of its own group a node
            recomputes itself (a record that accuses this node is always recomputed).
        check_assigned: judge a contribution by its gain on the batches it claims against
            control text of the run's train split; false judges it by its gain on
            validation text alone (for swarms whose nodes train on data of their own).
        check_budget: the largest share of a node's time in inner steps its checks may
            take: the forward passes of its records, its replays and its own trace
            (they run beside training, and each costly check waits while they are over
            it). 4 % leaves room within 5 % for what is not counted (fetching, serving
            its contributions and states).
        replay_steps: with checks on, every node traces its training in windows of at
            most this many inner steps (a start state kept per window) and the first
            checker drawn for a contribution trains one drawn window of it again
            (:mod:`verification.replay`): a window the member did not train does not
            replay. 0 turns replay checks off, and so does ``checkers = 0``. Longer
            windows keep fewer states and cost a checker more steps per check.
        replay_tolerance: the largest distance a replayed window's change may lie from
            the recorded one (relative to its size), and the largest difference of a
            step's loss (relative to the loss, at least 1), before the replay fails.
        replay_memory_mb: MiB of start states a node keeps in memory for its checkers;
            beyond them, states are written to files of its ``trace/`` folder (on a
            thread beside training). A state is kept until the round's seed shows
            whether a checker replays its window, so a node holds about one round's
            windows at a time (12 bytes a parameter each with AdamW).
    """

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    accept_unknown: bool = True
    aggregator: Aggregator = "mean"
    aggregator_params: dict[str, float | int] = Field(default_factory=dict)
    screening: bool = True
    norm_kappa: float = Field(default=3.0, gt=1, allow_inf_nan=False)
    min_cosine: float = Field(default=-0.1, ge=-1, le=1)
    max_tokens: int = Field(default=10**9, ge=1)
    max_share: float = Field(default=1.0, gt=0, le=1)
    on_violation: Literal["drop", "quarantine", "ban"] = "quarantine"
    outlier_rounds: int = Field(default=1, ge=1)
    outlier_window: int = Field(default=5, ge=1)
    quarantine_rounds: int = Field(default=5, ge=1)
    min_reputation: float = Field(default=0.0, ge=0, le=1)
    state_signers: int = Field(default=2, ge=1)
    violations_to_ban: int = Field(default=0, ge=0)
    on_proof: Literal["quarantine", "ban"] = "ban"
    max_missed: int = Field(default=3, ge=1)
    missed_window: int = Field(default=10, ge=1)
    checkers: int = Field(default=0, ge=0, le=16)
    check_windows: int = Field(default=16, ge=1, le=64)
    check_fragments: int = Field(default=1, ge=1)
    check_from_round: int = Field(default=3, ge=1)
    check_min_records: int = Field(default=4, ge=1)
    check_min_work: float = Field(default=0.5, ge=0, le=1)
    check_min_specific: float = Field(default=0.7, ge=0)
    check_rounds: int = Field(default=3, ge=0)
    check_audit: float = Field(default=0.1, ge=0, le=1)
    check_assigned: bool = True
    check_budget: float = Field(default=0.04, gt=0, le=1)
    replay_steps: int = Field(default=0, ge=0, le=1024)
    replay_tolerance: float = Field(default=0.05, gt=0, le=1)
    replay_memory_mb: int = Field(default=2048, ge=0)

    @field_validator("allow", "deny")
    @classmethod
    def _peer_ids(cls, peers: tuple[str, ...]) -> tuple[str, ...]:
        for index, peer in enumerate(peers):
            if not is_peer_id(peer):
                raise ValueError(
                    f"entry {index} ({peer!r}) is not a libp2p PeerID: expected base58, "
                    f"{_PEER_ID_LEN[0]}-{_PEER_ID_LEN[1]} characters, starting with 12D3KooW or Qm"
                )
        return peers

    @field_validator("aggregator_params")
    @classmethod
    def _finite_params(cls, params: dict[str, float | int]) -> dict[str, float | int]:
        for name, value in params.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} = {value!r}: must be a finite number")
        return params

    @model_validator(mode="after")
    def _consistent(self) -> TrustPolicy:
        overlap = sorted(set(self.allow) & set(self.deny))
        if overlap:
            raise ValueError(f"allow and deny overlap: {', '.join(overlap)}")
        if not self.accept_unknown and not self.allow:
            # Such a node would refuse every peer; almost surely a forgotten allow list.
            raise ValueError("accept_unknown = false with an empty allow list admits no peer")
        _check_aggregator(self.aggregator, self.aggregator_params)
        return self

    def admits(self, peer: str) -> tuple[bool, str]:
        """Whether contributions from ``peer`` are accepted at all.

        Args:
            peer: the sender's PeerID.

        Returns:
            ``(True, "")``, or ``(False, "denied")`` for a peer on the deny list, or
            ``(False, "not_allowed")`` for an unknown peer when unknown peers are
            not accepted.
        """
        if peer in self.deny:
            return False, "denied"
        if peer in self.allow or self.accept_unknown:
            return True, ""
        return False, "not_allowed"

    def action_for(self, violations: int) -> str:
        """What a violation costs a peer that has now committed ``violations`` of them.

        Args:
            violations: the peer's violation count, including this one.

        Returns:
            ``"ban"`` once ``violations_to_ban`` is set and reached, else
            :attr:`on_violation` (``"drop"``, ``"quarantine"`` or ``"ban"``).
        """
        if violations < 0:
            raise ValueError(f"violations must be >= 0, got {violations}")
        if self.violations_to_ban and violations >= self.violations_to_ban:
            return "ban"
        return self.on_violation


def _check_aggregator(name: str, params: dict[str, float | int]) -> None:
    """Run the aggregator once on a toy input so bad parameters fail at load time."""
    import torch

    from verification.aggregators import aggregate

    n = 3 + int(params.get("f", 0)) + int(params.get("m", 0) or 0)
    try:
        aggregate(name, [torch.zeros(2)] * n, [1.0] * n, params)
    except ValueError as exc:
        raise ValueError(f"aggregator_params for {name}: {exc}") from None
