"""Who else is in the run: this node's registry record and its view of the others.

Every few seconds a node rewrites its signed registry record in the DHT (round, step,
addresses, control addresses, whether it can be dialled, the digest of the run spec
it runs, and a random id of its process) and reads everyone else's. Every read returns
one record per node, so in a swarm larger than ``network.base_rate_peers`` the refresh, and
with it the time after which a silent record counts as gone, stretch in proportion to
the swarm's size: what a node reads per second stays flat as the swarm grows. From the
records:

* **live peers**: fresh records of the same spec; they are waited for in matchmaking
  and asked for state;
* **refused peers**: fresh records of another spec, with the reason (shown in
  ``atoll status``);
* **one key, two processes**: a fresh record under this node's own PeerID written by
  another process means a copied data directory. At start the node waits a moment to
  see whether that record is still being refreshed (a node restarting after a crash
  leaves one behind that is not) and refuses to start if it is; while running, the
  process that started later stops.
* **cut off**: a node whose registry view is empty, or holds under half of the peers
  its control channel hears, re-joins the DHT (hivemind drops a peer from its routing
  table when a request to it fails, so a link that went down and came back can leave
  a node with connections but no routes): it dials its initial peers and every peer
  it has seen, pings them into its routing table and looks up its neighbours again,
  with exponential backoff.

The registry is ``network.registry_shards`` DHT keys (one by default); a node whose
shards hold more than :data:`SHARD_RECORDS_WARN` records each says so once, because
the few DHT nodes storing a key serve all of its records to every node.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from protocol import registry
from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.registry import PeerRecord
from verification.identity import Identity

__all__ = [
    "LIVE_SECONDS",
    "SHARD_RECORDS_WARN",
    "DuplicateIdentityError",
    "PeerView",
    "PeerViewSettings",
]

logger = logging.getLogger(__name__)

LIVE_SECONDS = 10.0
"""A registry record older than this is a peer presumed gone (in a swarm of up to
``base_rate_peers`` nodes; see :attr:`PeerView.live_seconds`)."""

SHARD_RECORDS_WARN = 512
"""Records per registry shard above which a node warns, once, that the shards are too
few for the swarm (``network.registry_shards``, about ``n / 256``)."""

_REDIAL_SECONDS = (2.0, 60.0)  # first and longest wait between re-joins of the DHT
_REJOIN_KNOWN = 8  # peers seen before that a re-join dials, besides the initial peers


class DuplicateIdentityError(ValueError):
    """Another running node uses this node's identity key."""


@dataclass
class _Redial:
    attempts: int = 0
    next_at: float = 0.0


@dataclass(frozen=True)
class PeerViewSettings:
    """Where a node's registry record goes and how often it is refreshed (built by
    :func:`node.settings.peer_view_settings` from ``[run]`` and ``[network]``).

    Attributes:
        run_id: the run.
        spec: digest of the run spec (or shared settings) this node runs.
        key_file: where the node's key lives (named in the duplicate-identity error).
        initial_peers: multiaddrs re-dialled when every peer is lost.
        request_timeout: deadline of one DHT operation, in seconds.
        registry_seconds: how often the record is refreshed in a small swarm, in seconds.
        base_rate_peers: the swarm size above which refreshes stretch
            (``network.base_rate_peers``).
        registry_shards: DHT keys the registry is split over (``network.registry_shards``).
    """

    run_id: str
    spec: str
    key_file: Path
    initial_peers: tuple[str, ...] = ()
    request_timeout: float = 30.0
    registry_seconds: float = 2.0
    base_rate_peers: int = 8
    registry_shards: int = 1


class PeerView:
    """This node's record in the registry and what it knows of the others.

    Args:
        transport: the node's transport.
        identity: the node's key.
        settings: the run, the spec, the registry's pace and shards.
        heard: the peers this node's control channel hears (another view of who is
            live, through another connection), for telling a cut-off DHT apart from
            an empty swarm.
    """

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        settings: PeerViewSettings,
        heard: Callable[[], set[str]] = set,
    ) -> None:
        self.transport = transport
        self.identity = identity
        self.settings = settings
        self.me = identity.peer_id
        self.spec = settings.spec
        self.shards = settings.registry_shards
        self.instance = secrets.token_hex(8)
        self.started = time.time()
        self.records: dict[str, PeerRecord] = {}
        self.conflict: str | None = None
        """Set when another process runs with this key (this one must stop)."""
        self.heard = heard
        self._redial = _Redial()
        self._known: dict[str, tuple[str, ...]] = {}  # every peer seen, and where
        self._next_refresh = 0.0
        self._warned_shards = False

    # ---- pace --------------------------------------------------------------------------

    @property
    def stretch(self) -> float:
        """``max(1, n / base_rate_peers)`` for the ``n`` nodes with a record in the registry."""
        return max(1.0, len(self.records.keys() | {self.me}) / self.settings.base_rate_peers)

    @property
    def interval(self) -> float:
        """Seconds between two refreshes of the record and the view."""
        return self.settings.registry_seconds * self.stretch

    @property
    def live_seconds(self) -> float:
        """Age after which a record is a peer presumed gone."""
        return LIVE_SECONDS * self.stretch

    def due(self) -> bool:
        """Whether :meth:`refresh` is due (one :attr:`interval` after the last one)."""
        return time.monotonic() >= self._next_refresh

    # ---- this node's record -------------------------------------------------------------

    def record(self, round_: int, step: int, control: Sequence[str] = ()) -> PeerRecord:
        """This node's registry record as of now."""
        return PeerRecord(
            peer=self.me,
            round=round_,
            step=step,
            maddrs=tuple(self.transport.maddrs),
            updated=time.time(),
            control=tuple(control),
            reachable=self.transport.reachability.reachable,
            spec=self.spec,
            instance=self.instance,
            started=self.started,
        )

    async def refresh(self, record: PeerRecord) -> None:
        """Publish ``record``, then :meth:`read`."""
        self._next_refresh = time.monotonic() + self.interval
        await self.publish(record)
        await self.read()

    async def publish(self, record: PeerRecord) -> None:
        """Write this node's ``record`` to the registry now (a failed write is logged at
        debug level; the next refresh writes it again)."""
        try:
            await registry.publish_record(
                self.transport,
                self.identity,
                self.settings.run_id,
                record,
                expiration=self.live_seconds,
                timeout=self.settings.request_timeout,
                shards=self.shards,
            )
        except ProtocolError as exc:
            logger.debug("registry write failed: %s", exc)

    async def read(self) -> None:
        """Read the registry and act on what it says (a twin, isolation, too few shards)."""
        try:
            self.records = await self._read_registry()
        except ProtocolError as exc:
            logger.debug("registry read failed: %s", exc)
        for peer, rec in self.records.items():
            if peer != self.me and rec.spec == self.spec and rec.maddrs:
                self._known[peer] = tuple(rec.maddrs)
        self._check_twin(self.records.get(self.me))
        self._check_shards()
        await self._rejoin_if_cut_off()

    async def _read_registry(self) -> dict[str, PeerRecord]:
        return await registry.read_registry(
            self.transport,
            self.settings.run_id,
            timeout=self.settings.request_timeout,
            shards=self.shards,
            previous=self.records,
        )

    def _check_shards(self) -> None:
        count = len(self.records)
        if self._warned_shards or count <= SHARD_RECORDS_WARN * self.shards:
            return
        self._warned_shards = True
        logger.warning(
            "the registry holds %d records in %d DHT key(s): the few DHT nodes storing each "
            "key serve all of its records to every node; set network.registry_shards to "
            "about %d on every node of the run (a shared setting)",
            count,
            self.shards,
            max(2, count // 256),
        )

    # ---- views ------------------------------------------------------------------------

    def fresh(self, now: float | None = None) -> dict[str, PeerRecord]:
        """Records of other nodes written within :attr:`live_seconds`."""
        now = time.time() if now is None else now
        live = self.live_seconds
        return {p: r for p, r in self.records.items() if p != self.me and now - r.updated < live}

    def live(self) -> set[str]:
        """Peers of this run and spec whose record is fresh (this node excluded)."""
        return {p for p, r in self.fresh().items() if r.spec == self.spec}

    def refused(self) -> dict[str, str]:
        """Fresh peers of another spec, with why they are refused."""
        return {
            p: f"spec_mismatch: runs spec {r.spec[:12] or '(none)'}, this node runs {self.spec[:12]}"
            for p, r in self.fresh().items()
            if r.spec != self.spec
        }

    def reachable(self, peer: str) -> bool:
        """Whether ``peer`` said it can be dialled (unknown peers count as reachable)."""
        rec = self.records.get(peer)
        return rec is None or rec.reachable

    def behind(self, round_: int) -> list[str]:
        """Live peers whose last finished round is before ``round_``."""
        fresh = self.fresh()
        return [p for p in self.live() if fresh[p].round < round_]

    def sources(self, min_round: int) -> list[PeerRecord]:
        """Live, dialable peers at ``min_round`` or later, newest round first."""
        fresh = self.fresh()
        return sorted(
            (fresh[p] for p in self.live() if fresh[p].reachable and fresh[p].round >= min_round),
            key=lambda r: (-r.round, r.peer),
        )

    def among(self, peers: Sequence[str]) -> list[PeerRecord]:
        """Records to fetch state from ``peers`` by (every peer that signed a state: the
        dialable ones in the registry as it shows them, the others by PeerID alone, for
        p2pd to route), in the order given."""
        fresh = self.fresh()
        out = []
        for p in peers:
            rec = fresh.get(p)
            if rec is None:
                out.append(PeerRecord(peer=p, round=0, step=0, maddrs=(), updated=0.0))
            elif rec.reachable:
                out.append(replace(rec, round=0))  # one round for all: spread over them
        return out

    # ---- one key, two processes -------------------------------------------------------

    async def ensure_identity_free(self, clock: Callable[[], float] = time.time) -> None:
        """Refuse to start if another running process uses this node's key.

        A fresh record under this node's PeerID from another process may be left by
        a previous run of this very node (crashed or restarted within seconds), so
        it counts only if it is refreshed again while this node waits.

        Raises:
            DuplicateIdentityError: naming the key file and where the other runs.
        """
        first = await self._own_record()
        if first is None or first.instance == self.instance:
            return
        if clock() - first.updated >= self.live_seconds:
            return
        await asyncio.sleep(2 * self.interval + 1.0)
        second = await self._own_record()
        if (
            second is not None
            and second.instance != self.instance
            and second.updated > first.updated
        ):
            raise DuplicateIdentityError(self._twin_message(second))

    async def _own_record(self) -> PeerRecord | None:
        try:
            records = await self._read_registry()
        except ProtocolError:
            return None
        self.records = records  # a first view, which also sets the pace
        return records.get(self.me)

    def _check_twin(self, rec: PeerRecord | None) -> None:
        if rec is None or rec.instance == self.instance or self.conflict is not None:
            return
        if time.time() - rec.updated >= self.live_seconds or rec.updated < self.started:
            return
        # Both processes see each other's record; the one that started later stops.
        if (rec.started, rec.instance) < (self.started, self.instance):
            self.conflict = self._twin_message(rec)
            logger.error("%s", self.conflict)

    def _twin_message(self, rec: PeerRecord) -> str:
        where = ", ".join(rec.maddrs[:2]) or "an unknown address"
        return (
            f"another node is running with the identity key {self.settings.key_file} "
            f"(PeerID {self.me}, at {where}): every node needs its own key; give this one "
            "its own data directory, or run `atoll keygen --force` in it"
        )

    # ---- isolation --------------------------------------------------------------------

    def cut_off(self) -> str | None:
        """Why this node's registry view looks cut off from the swarm, or None: no live
        peer while it has someone to re-join through, or fewer than half of the peers
        its control channel hears."""
        live, heard = self.live(), self.heard() - {self.me}
        # Peers of another spec in the registry: it is read, so the DHT is not what is
        # wrong (re-joining would find the same peers; `atoll status` lists them).
        if not live and not self.refused() and (self.settings.initial_peers or self._known):
            return f"the registry shows no live peer (the control channel hears {len(heard)})"
        if heard and len(live) < len(heard) / 2:
            return (
                f"the registry shows {len(live)} live peers, the control channel hears {len(heard)}"
            )
        return None

    async def _rejoin_if_cut_off(self) -> None:
        why = self.cut_off()
        if why is None:
            self._redial = _Redial()
            return
        now = time.monotonic()
        if now < self._redial.next_at:
            return
        self._redial.attempts += 1
        wait = min(_REDIAL_SECONDS[1], _REDIAL_SECONDS[0] * 2 ** (self._redial.attempts - 1))
        self._redial.next_at = now + wait
        # the initial peers, and a few peers seen before: the ones heard now first
        heard = self.heard()
        known = sorted(self._known, key=lambda p: (p not in heard, p))[:_REJOIN_KNOWN]
        targets = list(self.settings.initial_peers)
        for peer in known:
            targets += [m if "/p2p/" in m else f"{m}/p2p/{peer}" for m in self._known[peer]]
        targets = [m for m in dict.fromkeys(targets) if not m.endswith(f"/p2p/{self.me}")]
        logger.warning(
            "%s: re-joining the DHT through %d address(es) (attempt %d, next in %.0f s)",
            why,
            len(targets),
            self._redial.attempts,
            wait,
        )
        joined = await self.transport.rejoin(targets, self.settings.request_timeout)
        if joined:
            # still cut off at the next refresh: tried again after the wait it printed
            logger.info("re-joined the DHT through %d peer address(es)", joined)
