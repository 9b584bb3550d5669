"""The parts of a running node, each group built at once by one builder.

:func:`build_training` makes what trains (the model, its fragment plan, the outer
optimizer, the inner trainer, the site's ranks) and :func:`start_network` starts what
talks to the swarm (transport, peer view, verifier, control plane, all-reduce, syncer,
state server), in that order. :class:`Progress` is where the training stands, shared
by the training loop (:mod:`node.run.loop`), the round's end (:mod:`node.run.rounds`) and the
reports (:mod:`node.ops.reporter`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from node.checks import CheckHooks, CheckParts, Fetcher, FetchSettings, Measurer, UsefulWork
from node.checks.replay import Replayer
from node.checks.trace import REPLAY_RPC, Tracer, TraceSettings
from node.config import AtollConfig
from node.data.corpus import BatchStream, load_data, validation_batches
from node.ops.handoff import workload_record
from node.ops.simulate import resolve_device
from node.run.admin import AdminInbox, Command
from node.run.load import LoadMeter
from node.run.metrics import EventLog
from node.run.state import Network, NetworkInputs, Progress, Training, control_traffic
from node.run.syncer import Copies, SyncWatchers
from node.settings import (
    allreduce_settings,
    check_settings,
    control_settings,
    exchange_settings,
    peer_view_settings,
    replay_settings,
    sync_settings,
)
from node.swarm.byzantine import make_behaviour, trainer_class, training_data
from node.swarm.peers import PeerView
from node.train.deadlines import Deadlines
from node.train.model import build_model, vocab_of
from node.train.outer import OuterOptimizer
from node.train.site import SiteGroup, SiteRank, rank_data, stream_key
from node.train.site_leader import NoSite, SiteLeader
from protocol.averaging.allreduce import AllReduceService
from protocol.averaging.exchange import FragmentExchange
from protocol.averaging.fragments import plan_fragments
from protocol.averaging.hooks import Hooks
from protocol.control.heartbeats import SelfReport
from protocol.control.plane import ControlPlane
from protocol.p2p.transport import Transport
from protocol.stateserver import StateServer
from protocol.wire.feedback import FeedbackSettings
from verification.verifier import Verifier

__all__ = [
    "Hearing",
    "Network",
    "NetworkInputs",
    "Progress",
    "Training",
    "apply_operator",
    "build_training",
    "start_network",
]


def build_training(
    cfg: AtollConfig, key: str, site: SiteRank | None, byzantine: str | None
) -> Training:
    """The model, its plan, the outer and inner optimizers and the data stream.

    Args:
        cfg: the node's configuration.
        key: the node's PeerID, which keys its batch stream.
        site: this process's rank when the node is a site's leader.
        byzantine: a fault-injection mode (tests and benchmarks only).
    """
    group: SiteGroup | None = None
    if site is None:
        device = resolve_device(cfg.run.device)
    else:
        # the site's leader: its ranks train in step with it (node.train.site)
        device = site.device(cfg.run.device)
        group = SiteGroup(site, device, cfg.train.sharding)
        key = group.agree_key(key)
    try:
        return _training(cfg, key, site, byzantine, device, group)
    except BaseException:
        if group is not None:
            group.close()  # the caller holds none of it yet
        raise


def _training(
    cfg: AtollConfig,
    key: str,
    site: SiteRank | None,
    byzantine: str | None,
    device: torch.device,
    group: SiteGroup | None,
) -> Training:
    sharded = group is not None and group.sharded
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
    # under FSDP the node's full copies (local, global, eval) live in CPU memory
    model = build_model(cfg.model, seed=cfg.run.seed).to(torch.device("cpu") if sharded else device)
    plan = plan_fragments(model, cfg.sync.fragments)
    pin = device.type == "cuda"  # beside a GPU the outer state is pinned host memory
    train = training_data(byzantine, rank_data(cfg, corpus.train, site), cfg.run.seed)
    stream = BatchStream(train, cfg.data.batch_size, cfg.model.context, stream_key(key, site))
    leader: SiteLeader | NoSite = NoSite()
    trained, ranks = model, 1
    if group is not None:
        module = build_model(cfg.model, seed=cfg.run.seed).to(device) if sharded else model
        trained, ranks = group.wrap(module), group.site.world
        leader = SiteLeader(group, model, module)
    return Training(
        device=device,
        model=model,
        plan=plan,
        outer=OuterOptimizer(model, plan, cfg.outer, pin=pin),
        trainer=trainer_class(byzantine)(trained, cfg.train, stream, device, ranks=ranks),
        feedback=[
            FeedbackSettings(
                cfg.sync.codec,
                **cfg.sync.codec_args(),
                stochastic=cfg.sync.stochastic_rounding,
                pin_memory=pin,
                decay=cfg.sync.feedback_decay,
            ).build(torch.Generator().manual_seed(f + 1))
            for f in range(len(plan))
        ],
        val_batches=validation_batches(
            corpus.val, cfg.data.batch_size, cfg.model.context, cfg.train.eval_batches
        ),
        tokens=(corpus.train, corpus.val),
        bytes_per_token=corpus.bytes_per_token,
        workload=workload_record(cfg, corpus.tokenizer),
        site=leader,
    )


class Hearing:
    """Peers of this run and spec whose heartbeats the control channel hears now:
    another view of who is live than the registry's, over other connections. Empty
    until the channel is attached (and always, without a control plane)."""

    def __init__(self, spec_digest: str) -> None:
        self.spec_digest = spec_digest
        self.control: ControlPlane | None = None

    def __call__(self) -> set[str]:
        if self.control is None:
            return set()
        heard = self.control.heard()
        return {p for p, info in heard.items() if info.get("spec") == self.spec_digest}


def start_network(
    cfg: AtollConfig,
    transport: Transport,
    inputs: NetworkInputs,
    training: Training,
    events: EventLog,
    vitals: Callable[[], dict[str, Any]],
) -> Network:
    """Everything on top of a started transport, started in order: the peer view (and
    the check that no other process runs with this key), the verifier, the operator's
    inbox, the control plane, the all-reduce, the fragment exchange, the syncer and the
    catch-up state server."""
    net, key_file, identity = cfg.network, inputs.data_dir / "identity.key", inputs.identity
    hearing = Hearing(inputs.spec_digest)
    view = peer_view_settings(cfg, key_file, inputs.spec_digest, inputs.initial_peers)
    peers = PeerView(transport, identity, view, heard=hearing)
    transport.run(peers.ensure_identity_free(), 4 * net.request_timeout + 10)
    db = inputs.data_dir / "atoll.db"
    verifier = Verifier(cfg.trust, db, identity.peer_id, events, inputs.clock)
    control: ControlPlane | None = None
    try:
        if cfg.control.enabled:
            settings = control_settings(cfg, key_file, inputs.data_dir)
            report = SelfReport(vitals, inputs.version)
            control = ControlPlane(settings, identity, transport, verifier, events, report)
            control.start()
            hearing.control = control
        return _swarm_side(cfg, transport, inputs, training, events, peers, verifier, control)
    except BaseException:
        # what started here is stopped here: the caller holds none of it yet
        if control is not None:
            control.close()
        verifier.close()
        raise


def _swarm_side(
    cfg: AtollConfig,
    transport: Transport,
    inputs: NetworkInputs,
    training: Training,
    events: EventLog,
    peers: PeerView,
    verifier: Verifier,
    control: ControlPlane | None,
) -> Network:
    """The all-reduce, the fragment exchange, the syncer and the state server."""
    identity = inputs.identity
    admin = AdminInbox(inputs.data_dir, partial(apply_operator, verifier, control))
    commitments = control.commitments if control is not None and cfg.control.commit else None
    hooks = Hooks(
        reducer=verifier.reducer.reduce,
        planner=verifier.reducer.stream_plan,
        judge=verifier,
        commitments=commitments,
        faults=make_behaviour(inputs.byzantine, cfg.run.seed, training.outer.global_vector),
    )
    settings = allreduce_settings(cfg, len(training.plan))
    allreduce = AllReduceService(transport, identity, settings, hooks, inputs.clock)
    allreduce.register()
    settings = exchange_settings(cfg, inputs.spec_digest, len(training.plan))
    exchange = FragmentExchange(transport, identity, allreduce, settings)
    checks, tracer = _useful_work(cfg, inputs, training, events, verifier, control, allreduce)
    deadlines = Deadlines(cfg.network.adaptive_deadlines)
    copies = Copies(training.model, training.outer, training.feedback, training.device)
    watchers = SyncWatchers(checks, deadlines)
    syncer = sync_settings(cfg).build(copies, exchange, transport.submit, events, watchers)
    state_server = StateServer(transport, identity, cfg.run.run_id, inputs.data_dir / "state")
    state_server.register()
    if checks is not None:
        checks.start()
    return Network(
        transport=transport,
        peers=peers,
        hearing=peers.heard,
        verifier=verifier,
        admin=admin,
        control=control,
        allreduce=allreduce,
        exchange=exchange,
        syncer=syncer,
        deadlines=deadlines,
        checks=checks,
        state_server=state_server,
        load=_load_meter(transport, control),
        tracer=tracer,
    )


def _useful_work(
    cfg: AtollConfig,
    inputs: NetworkInputs,
    training: Training,
    events: EventLog,
    verifier: Verifier,
    control: ControlPlane | None,
    allreduce: AllReduceService,
) -> tuple[UsefulWork | None, Tracer | None]:
    """The useful-work checks when the policy asks for them (``trust.checkers``): this
    node keeps and serves its contributions, checks its share and judges records (not
    started yet); with replay checks, the trace of its training it serves its checkers
    (:mod:`node.checks.trace`), whose time counts in the checks' budget."""
    if not cfg.trust.checkers or control is None:
        return None, None
    settings = check_settings(cfg)
    sent = allreduce.keep_contributions()
    plan = training.plan
    numel = tuple(plan[f].numel for f in range(len(plan)))
    fetching = FetchSettings(allreduce.settings, numel, settings.timeout)
    me, committed = inputs.identity.peer_id, control.commitments.digests
    fetcher = Fetcher(me, allreduce.transport, fetching, committed, sent)
    train, val = training.tokens
    measurer = Measurer(settings, training.model, plan, train, val, training.device)
    replayer = tracer = None
    if cfg.trust.replay_steps:
        replaying = replay_settings(cfg)
        model, device = training.model, training.device
        replayer = Replayer(replaying, model, train, device, fetcher.replay, plan)
        tracing = TraceSettings(
            cfg.run.run_id,
            cfg.trust.replay_steps,
            cfg.train.grad_accum,
            spill=inputs.data_dir / "trace",
            memory=cfg.trust.replay_memory_mb << 20,
        )
        tracer = Tracer(tracing, inputs.identity, plan)
        allreduce.transport.add_handler(REPLAY_RPC, tracer.serve, max_request_bytes=128)
    parts = CheckParts(inputs.identity, verifier, measurer, fetcher, replayer, tracer)
    hooks = CheckHooks(control.publish_check, events.write, lambda: training.trainer.seconds)
    checks = UsefulWork(settings, len(plan), parts, hooks)
    control.on_check = checks.receive
    return checks, tracer


def _load_meter(transport: Transport, control: ControlPlane | None) -> LoadMeter:
    """What the node's helper processes cost: DHT and control traffic, their CPU."""
    return LoadMeter(
        lambda: dict(transport.dht_usage),
        partial(control_traffic, control),
        lambda: {
            "p2pd": transport.p2pd_pid,
            "dht": transport.dht_pid,
            "sidecar": control.sidecar_pid if control else None,
        },
    )


def apply_operator(verifier: Verifier, control: ControlPlane | None, command: Command) -> dict:
    """Apply one ``atoll ban`` / ``atoll pardon`` command; the peer's standing after it."""
    standing = verifier.operator(command.op, command.peer, command.reason)
    if command.op == "pardon" and control is not None:
        control.pardoned(command.peer)  # new proof of a new offence counts again
    return standing
