"""Each component's settings object, built from a node's validated configuration.

:mod:`node.config` turns TOML and overrides into an :class:`~node.config.AtollConfig`;
the functions here turn that into the frozen dataclass each component takes, so no
component reads the configuration itself. :mod:`node.config` re-exports them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: protocol.p2p.transport loads hivemind
    from node.checks import CheckSettings
    from node.checks.replay import ReplaySettings
    from node.config import AtollConfig
    from node.run.loop import LoopSettings
    from node.run.rounds import RoundSettings
    from node.run.syncer import SyncSettings
    from node.swarm.peers import PeerViewSettings
    from node.train.clock import ClockSettings
    from protocol.averaging.exchange import ExchangeSettings
    from protocol.averaging.parts import AllReduceSettings
    from protocol.catchup import CatchUpSettings
    from protocol.control.settings import ControlSettings
    from protocol.p2p.transport import TransportConfig

__all__ = [
    "allreduce_settings",
    "catchup_settings",
    "check_settings",
    "loop_settings",
    "replay_settings",
    "round_settings",
    "sync_settings",
    "clock_settings",
    "control_settings",
    "exchange_settings",
    "peer_view_settings",
    "transport_config",
]


def transport_config(
    cfg: AtollConfig, identity_path: Path, initial_peers: tuple[str, ...]
) -> TransportConfig:
    """The transport's settings: where p2pd listens, whom it joins, NAT options."""
    from protocol.p2p.transport import TransportConfig

    net = cfg.network
    return TransportConfig(
        host=net.host,
        port=net.port,
        initial_peers=initial_peers,
        identity_path=identity_path,
        announce_maddrs=net.announce_maddrs,
        dht_client_mode=net.client_mode,
        request_timeout=net.request_timeout,
        max_message_bytes=int(net.max_message_mb * 2**20),
        # a node that says peers cannot dial it is a client for parts as well as the DHT
        reachability="private" if net.client_mode else net.reachability,
        relay=net.relay,
        auto_relay=net.auto_relay,
        trusted_relays=net.trusted_relays,
        relay_parts=net.relay_parts,
        nat_port_map=net.nat_port_map,
        auto_nat=net.auto_nat,
        max_inbound_streams=net.max_inbound_streams,
        max_inbound_per_peer=net.max_inbound_per_peer,
        min_inbound_bytes_per_second=net.min_inbound_kib_per_second * 1024,
        data_plane=net.data_plane,
        data_port=net.data_port,
    )


def allreduce_settings(cfg: AtollConfig, fragments: int) -> AllReduceSettings:
    """The all-reduce's settings for a model of ``fragments`` fragments: pseudo-gradients
    in ``sync.codec``, the global copies that groups mix in ``sync.mix_codec``."""
    from protocol.averaging.parts import AllReduceSettings

    net, sync = cfg.network, cfg.sync
    return AllReduceSettings(
        run_id=cfg.run.run_id,
        codec=sync.codec,
        block_size=sync.chunk,
        topk_k=sync.codec_args().get("k", 0),
        topk_bits=sync.topk_bits,
        timeout=net.round_timeout,
        max_tokens=net.max_tokens_per_round,
        max_message_bytes=int(net.max_message_mb * 2**20),
        fragments=fragments,
        weights_codec=sync.mix_codec,
        stream_reduce=net.stream_reduce,
        gather=sync.exchange == "gather",
    )


def exchange_settings(cfg: AtollConfig, spec: str, fragments: int) -> ExchangeSettings:
    """How a fragment's exchange forms groups and waits for announcements."""
    from protocol.averaging.exchange import ExchangeSettings

    net = cfg.network
    return ExchangeSettings(
        run_id=cfg.run.run_id,
        spec=spec,
        fragments=fragments,
        group_size=net.group_size,
        layout=cfg.sync.layout,
        gossip=cfg.sync.averaging == "gossip",
        matchmaking_seconds=net.matchmaking_seconds,
        announce_expiration=net.round_timeout * 4,
        request_timeout=net.request_timeout,
        base_rate_peers=net.base_rate_peers,
        cells_above=net.cells_above,
    )


def loop_settings(cfg: AtollConfig) -> LoopSettings:
    """What the training loop reads: the run's length and pace, and the budget of an
    exchange."""
    from node.run.loop import LoopSettings

    run, net, sync = cfg.run, cfg.network, cfg.sync
    return LoopSettings(
        run_id=run.run_id,
        max_rounds=run.max_rounds,
        slowdown=run.slowdown,
        data_slice=(cfg.data.site, cfg.data.sites),
        matchmaking_seconds=net.matchmaking_seconds,
        round_timeout=net.round_timeout,
        alone_rounds=net.alone_rounds,
        commit_seconds=cfg.control.commit_seconds if cfg.control.commit else None,
        round_seconds=sync.round_seconds if sync.trigger == "seconds" else None,
    )


def round_settings(cfg: AtollConfig, data_dir: Path) -> RoundSettings:
    """What a round's end reads: checkpoints in ``data_dir/checkpoints``, evaluation, and
    how the node takes its peers' state."""
    from node.run.resync import ResyncSettings
    from node.run.rounds import RoundSettings

    run, net = cfg.run, cfg.network
    resync = ResyncSettings(
        run_id=run.run_id,
        catchup=catchup_settings(cfg),
        state_signers=cfg.trust.state_signers,
        request_timeout=net.request_timeout,
        round_timeout=net.round_timeout,
        matchmaking_seconds=net.matchmaking_seconds,
    )
    return RoundSettings(
        run_id=run.run_id,
        checkpoints=data_dir / "checkpoints",
        checkpoint_every=run.checkpoint_every,
        keep_checkpoints=run.keep_checkpoints,
        eval_every=run.eval_every,
        train=cfg.train,
        resync=resync,
    )


def sync_settings(cfg: AtollConfig) -> SyncSettings:
    """What a fragment's sync reads: its codecs, error feedback and the outer merge."""
    from node.run.syncer import SyncSettings

    sync = cfg.sync
    gossip = sync.averaging == "gossip"
    return SyncSettings(
        codec=sync.codec,
        codec_args=sync.codec_args(),
        error_feedback=sync.error_feedback,
        mix_codec=sync.mix_codec,
        block_size=sync.block_size,
        alpha=sync.alpha,
        gossip_pull=sync.gossip_gamma / cfg.outer.lr if gossip else None,
    )


def clock_settings(
    cfg: AtollConfig,
    spec: str,
    fragments: int,
    initial_peers: tuple[str, ...],
    spec_t0: float | None,
) -> ClockSettings:
    """How the node agrees its round clock: whose manifests it trusts (``run.clock_signers``,
    else its initial peers), the run's round length, how long it looks for one."""
    from node.train.clock import ClockSettings

    net = cfg.network
    joined = {m.rpartition("/p2p/")[2] for m in initial_peers if "/p2p/" in m}
    return ClockSettings(
        run_id=cfg.run.run_id,
        spec=spec,
        round_seconds=cfg.sync.round_seconds,
        fragments=fragments,
        signers=frozenset(cfg.run.clock_signers or joined),
        spec_t0=spec_t0,
        wait=10.0 if initial_peers else 0.0,
        lead=2 * net.registry_seconds + 1,
        timeout=net.request_timeout,
    )


def control_settings(cfg: AtollConfig, key_file: Path, data_dir: Path) -> ControlSettings:
    """The control plane's settings (``[control]``), its sidecar listening on
    ``network.host`` with the node's key, logging into ``data_dir/sidecar.log``."""
    from protocol.control.settings import ChannelSettings, ControlSettings

    control = cfg.control
    channel = ChannelSettings(
        key_file=key_file,
        run=cfg.run.run_id,
        max_bytes=int(control.max_message_kb * 1024),
        listen_host=cfg.network.host,
        port=control.port,
        announce_maddrs=control.announce_maddrs,
        log_path=data_dir / "sidecar.log",
    )
    return ControlSettings(
        channel=channel,
        heartbeat_seconds=control.heartbeat_seconds,
        commit=control.commit,
        commit_seconds=control.commit_seconds,
        dial_peers=control.dial_peers,
        base_rate_peers=control.base_rate_peers,
    )


def peer_view_settings(
    cfg: AtollConfig, key_file: Path, spec: str, initial_peers: tuple[str, ...]
) -> PeerViewSettings:
    """The registry view's settings: the run and spec, its pace and shards."""
    from node.swarm.peers import PeerViewSettings

    net = cfg.network
    return PeerViewSettings(
        run_id=cfg.run.run_id,
        spec=spec,
        key_file=key_file,
        initial_peers=tuple(initial_peers),
        request_timeout=net.request_timeout,
        registry_seconds=net.registry_seconds,
        base_rate_peers=net.base_rate_peers,
        registry_shards=net.registry_shards,
    )


def catchup_settings(cfg: AtollConfig) -> CatchUpSettings:
    """How a node takes a peer's state: the run, one request's deadline, the reply cap."""
    from protocol.catchup import CatchUpSettings

    net = cfg.network
    return CatchUpSettings(
        run_id=cfg.run.run_id,
        timeout=net.request_timeout,
        max_bytes=int(net.max_message_mb * 2**20),
    )


def check_settings(cfg: AtollConfig) -> CheckSettings:
    """Useful-work checks: the policy's ``check*`` keys, the batch shape, the deadline.

    Where replay checks run and the sent check binds the codec (not ``topk``, not int4),
    check records only weigh contributions: on small models and late in a run an honest
    contribution's measured effect swings too widely for records to charge anyone
    (docs/trust.md), and every quiet fault the checks benchmark tries fails a replay or
    sent check in its first checked round."""
    from node.checks import CheckSettings
    from verification.binding import binds

    t = cfg.trust
    return CheckSettings(
        run_id=cfg.run.run_id,
        checkers=t.checkers,
        windows=t.check_windows,
        fragments=t.check_fragments,
        from_round=t.check_from_round,
        audit=t.check_audit,
        assigned=t.check_assigned,
        context=cfg.model.context,
        timeout=cfg.network.request_timeout,
        budget=t.check_budget,
        records_charge=not (t.replay_steps > 0 and binds(cfg.sync.codec)),
    )


def replay_settings(cfg: AtollConfig) -> ReplaySettings:
    """Replay checks: ``trust.replay_*`` and the window shape."""
    from node.checks.claims import MAX_SPANS
    from node.checks.replay import ReplaySettings

    t = cfg.trust
    return ReplaySettings(
        run_id=cfg.run.run_id,
        steps=t.replay_steps,
        tolerance=t.replay_tolerance,
        context=cfg.model.context,
        train=cfg.train,
        codec=cfg.sync.codec,
        block_size=cfg.sync.block_size,
        stochastic=cfg.sync.stochastic_rounding,
        feedback=cfg.sync.error_feedback,
        spans=MAX_SPANS,
    )
