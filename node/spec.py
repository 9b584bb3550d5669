"""The signed run spec: the settings every node of a run shares, fixed once by its creator.

A bootstrap operator runs ``atoll spec create`` once: it takes the shared settings
(:data:`SHARED_KEYS`) from a config, adds the round clock's start ``t0`` and the
bootstrap multiaddrs, signs them with the operator's Ed25519 key and writes a TOML
file. Volunteers join with ``atoll run --spec FILE``: :func:`node.spec_file.read_spec`
checks the file and its signature, and :func:`apply_spec` lays the shared settings over
the node's own config, refusing any local value that differs, so no node trains another
model, codec or clock by accident.

A spec may be a later *version* of another (``atoll spec create --previous``): it then
carries the previous version whole, inside what it signs, and is trusted only if its
signer is the previous version's creator or one of the ``run.spec_signers`` that
version named, for the same run, all the way down the chain. An operator pin
(``--operator``, a run address) holds for a chain whose versions include one signed by
the pinned key, so an operator can rotate keys without volunteers changing their pin,
and nobody else can publish a version of the run. Nodes announce :attr:`RunSpec.digest`
(or, when started without a spec, :func:`settings_digest`) so peers on other settings
are told apart before they exchange anything::

    signed_bytes = msgpack({version, run_id, protocol, creator, created, t0,
                            bootstrap, shared[, previous]})  # keys sorted at every level
    previous     = msgpack([previous version's signed_bytes, its signature])
    digest       = sha256(signed_bytes)
    signature    = Ed25519(creator's key, b"atoll/spec/v1\\0" + digest)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import msgpack

from node.config import AtollConfig, ConfigError, build_config
from node.shared_settings import (
    SHARED_KEYS,
    canonical,
    same_value,
    settings_digest,
    shared_settings,
)
from protocol.wire.messages import PROTOCOL_VERSION
from verification.identity import Domain, Identity
from verification.policy import is_peer_id

__all__ = [
    "HEAD_KEYS",
    "MAX_VERSIONS",
    "SHARED_KEYS",
    "SIGNATURE_LEN",
    "SPEC_VERSION",
    "RunSpec",
    "SpecError",
    "apply_spec",
    "bad_signature",
    "bootstrap_problem",
    "create_spec",
    "settings_digest",
    "spec_changes",
    "version_line",
]

SPEC_VERSION = 1
"""Layout version of the spec file and of :meth:`RunSpec.signed_bytes`."""


_SPEC = Domain(b"atoll/spec/v1\0")
SIGNATURE_LEN = 64
_T0_LEAD_SECONDS = 60.0
HEAD_KEYS = (
    "version",
    "run_id",
    "protocol",
    "creator",
    "created",
    "t0",
    "bootstrap",
    "previous",
    "signature",
)
MAX_VERSIONS = 64
"""Versions a spec's chain may hold (each carries the one before it)."""


class SpecError(ValueError):
    """A run spec that cannot be made, read or trusted; one line naming the file."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run's shared settings, signed by the node that created the run.

    Attributes:
        run_id: the run's name (also ``shared["run"]["run_id"]``).
        protocol: the wire protocol version the run speaks.
        creator: PeerID of the key that signed the spec.
        created: when it was signed, ISO-8601 UTC (``2025-01-31T12:00:00Z``).
        t0: unix time at which round 1 starts for ``sync.trigger = "seconds"``;
            None for ``"steps"``.
        bootstrap: multiaddrs (each ending in ``/p2p/<peer id>``) to join through.
        shared: the shared settings, ``{section: {key: value}}`` for every key of
            :data:`SHARED_KEYS`.
        signature: the creator's 64-byte Ed25519 signature (see the module docstring).
        previous: the version this one replaces, as signed (``msgpack([signed_bytes,
            signature])``); None for a run's first spec.
    """

    run_id: str
    protocol: int
    creator: str
    created: str
    t0: float | None
    bootstrap: tuple[str, ...]
    shared: dict[str, dict[str, Any]]
    signature: bytes
    previous: bytes | None = None

    def signed_bytes(self) -> bytes:
        """Canonical msgpack of every field but the signature, with the spec version."""
        fields = {
            "version": SPEC_VERSION,
            "run_id": self.run_id,
            "protocol": self.protocol,
            "creator": self.creator,
            "created": self.created,
            "t0": self.t0,
            "bootstrap": self.bootstrap,
            "shared": self.shared,
        }
        if self.previous is not None:
            fields["previous"] = self.previous
        return msgpack.packb(canonical(fields), use_bin_type=True)

    @property
    def digest(self) -> str:
        """Hex SHA-256 of :meth:`signed_bytes`: what nodes announce to find peers on another spec."""
        return hashlib.sha256(self.signed_bytes()).hexdigest()

    @property
    def short(self) -> str:
        """The first 12 hex characters of :attr:`digest`, for messages."""
        return self.digest[:12]

    @property
    def signers(self) -> tuple[str, ...]:
        """Who may sign this spec's next version: its creator and ``run.spec_signers``."""
        return tuple(dict.fromkeys((self.creator, *self.shared["run"]["spec_signers"])))

    def chain(self) -> list[RunSpec]:
        """This version and every one before it, newest first (signatures unchecked:
        :func:`node.spec_file.parse_spec` checks the chain)."""
        out: list[RunSpec] = [self]
        while out[-1].previous is not None and len(out) <= MAX_VERSIONS:
            out.append(_unpack_version(out[-1].previous))
        return out

    def verify(self) -> None:
        """Check the creator's signature.

        Raises:
            SpecError: if the signature is not ``creator``'s over these fields.
        """
        if not self._signature_ok():
            raise SpecError(f"run spec {self.short}: {bad_signature(self.creator)}")

    def _signature_ok(self) -> bool:
        return _SPEC.verify(self.creator, _digest(self.signed_bytes()), self.signature)


def create_spec(
    cfg: AtollConfig,
    identity: Identity,
    bootstrap: Sequence[str] = (),
    t0: float | None = None,
    now: float | None = None,
    previous: RunSpec | None = None,
) -> RunSpec:
    """Sign a spec of ``cfg``'s shared settings with ``identity``.

    Args:
        cfg: the validated config the shared settings are taken from.
        identity: the creator's key.
        bootstrap: multiaddrs ending in ``/p2p/<peer id>`` that joining nodes dial.
        t0: round 1's start (unix time) for ``sync.trigger = "seconds"``; by default
            the first multiple of ``sync.round_seconds`` at least 60 s from ``now``,
            so every node has time to start before the clock does.
        now: the current unix time (for tests); ``time.time()`` when None.
        previous: the version this one replaces (verified by the caller): the new one
            is for the same run, signed by one of ``previous.signers``, and keeps its
            ``t0`` unless one is given.

    Raises:
        SpecError: a bootstrap entry that is not a ``/p2p/`` multiaddr, a ``t0``
            that is not finite or is given for the ``steps`` trigger, or a
            ``previous`` of another run or whose signers do not include ``identity``.
    """
    now = time.time() if now is None else float(now)
    if previous is not None:
        if cfg.run.run_id != previous.run_id:
            raise SpecError(
                f"run.run_id = {cfg.run.run_id!r}, but the previous version is of run "
                f"{previous.run_id!r}: a new version keeps its run's id"
            )
        if identity.peer_id not in previous.signers:
            raise SpecError(
                f"key {identity.peer_id} may not sign a version of run {previous.run_id!r}: "
                f"its previous version {previous.short} names as signers "
                f"{', '.join(previous.signers)} (its creator and run.spec_signers)"
            )
        if t0 is None and cfg.sync.trigger == "seconds":
            t0 = previous.t0
    peers = tuple(bootstrap)
    for maddr in peers:
        problem = bootstrap_problem(maddr)
        if problem:
            raise SpecError(problem)
    if cfg.sync.trigger == "seconds":
        if t0 is None:
            period = cfg.sync.round_seconds
            t0 = math.ceil((now + _T0_LEAD_SECONDS) / period) * period
        if not math.isfinite(t0):
            raise SpecError(f"t0 = {t0!r}: expected a unix time")
        t0 = float(t0)
    elif t0 is not None:
        raise SpecError("t0 is the round clock's start, only for sync.trigger = 'seconds'")
    unsigned = RunSpec(
        run_id=cfg.run.run_id,
        protocol=PROTOCOL_VERSION,
        creator=identity.peer_id,
        created=datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        t0=t0,
        bootstrap=peers,
        shared=shared_settings(cfg),
        signature=b"",
        previous=None if previous is None else _pack_version(previous),
    )
    signature = _SPEC.sign(identity, _digest(unsigned.signed_bytes()))
    return dataclasses.replace(unsigned, signature=signature)


def spec_changes(old: RunSpec, new: RunSpec) -> list[str]:
    """What ``new`` changes of ``old``: one ``key: old -> new`` line per shared setting,
    and the bootstrap addresses and ``t0`` where they moved."""
    lines = [
        f"{section}.{key}: {old.shared[section][key]!r} -> {new.shared[section][key]!r}"
        for section, keys in SHARED_KEYS.items()
        for key in keys
        if old.shared[section][key] != new.shared[section][key]
    ]
    if old.t0 != new.t0:
        lines.append(f"t0: {old.t0!r} -> {new.t0!r}")
    if old.bootstrap != new.bootstrap:
        lines.append(f"bootstrap: {' '.join(old.bootstrap)} -> {' '.join(new.bootstrap)}")
    return lines


def version_line(spec: RunSpec) -> str | None:
    """One line saying which version of its run ``spec`` is and what it changed of the
    one before (None for a run's first spec): what a node logs at start and ``atoll
    spec create --previous`` prints."""
    chain = spec.chain()
    if len(chain) < 2:
        return None
    before = chain[1]
    changed = "; ".join(spec_changes(before, spec)) or "nothing but the signer"
    return (
        f"run spec {spec.short} is version {len(chain)} of run {spec.run_id!r}, signed by "
        f"{spec.creator}; it replaces spec {before.short} by {before.creator}; changed: {changed}"
    )


def _pack_version(spec: RunSpec) -> bytes:
    return msgpack.packb([spec.signed_bytes(), spec.signature], use_bin_type=True)


def _unpack_version(data: bytes) -> RunSpec:
    """A previous version from :func:`_pack_version`'s bytes (its signature unchecked).

    Raises:
        SpecError: bytes that are not a packed version, or whose fields are not the
            canonical encoding they were signed as.
    """
    bad = SpecError("spec.previous is not a packed run spec")
    try:
        signed, signature = msgpack.unpackb(data, raw=False)
        fields = msgpack.unpackb(signed, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise bad from None
    if not (isinstance(signed, bytes) and isinstance(signature, bytes)):
        raise bad
    if not isinstance(fields, dict) or fields.get("version") != SPEC_VERSION:
        raise bad
    try:
        t0 = fields["t0"]
        spec = RunSpec(
            run_id=fields["run_id"],
            protocol=fields["protocol"],
            creator=fields["creator"],
            created=fields["created"],
            t0=None if t0 is None else float(t0),
            bootstrap=tuple(fields["bootstrap"]),
            shared=fields["shared"],
            signature=signature,
            previous=fields.get("previous"),
        )
        same = spec.signed_bytes() == signed and set(fields) <= {*HEAD_KEYS, "shared"}
        spec.signers  # noqa: B018  (a spec that names no signers is not one)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise bad from None
    if not same or not is_peer_id(spec.creator):
        raise bad
    return spec


def apply_spec(spec: RunSpec, data: dict[str, Any]) -> AtollConfig:
    """Lay ``spec``'s shared settings over a node's own raw config.

    Args:
        spec: a verified spec.
        data: the node's merged TOML files and ``--set`` overrides, before defaults
            (:func:`node.config.load_config_data`).

    Returns:
        The validated config with the spec's shared values, and the spec's bootstrap
        multiaddrs as ``network.initial_peers`` unless ``data`` sets them.

    Raises:
        ConfigError: a shared key that ``data`` sets to another value than the spec
            (equal values, after validation, are fine), or an invalid local value.
    """
    tables: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config error: [{section}] must be a table, got {values!r}")
        tables[section] = dict(values)
    differing = [
        f"{section}.{key} = {tables[section][key]!r} differs from the run spec's "
        f"{spec.shared[section][key]!r}"
        for section, keys in SHARED_KEYS.items()
        for key in keys
        if key in tables.get(section, {})
        and not same_value(section, key, tables[section][key], spec.shared[section][key])
    ]
    if differing:
        which = "the key" if len(differing) == 1 else "these keys"
        raise ConfigError(
            f"config error: {', '.join(differing)} (run spec {spec.short}); "
            f"shared settings come from the spec: remove {which} from your config"
        )
    for section, values in spec.shared.items():
        tables.setdefault(section, {}).update(values)
    if spec.bootstrap and "initial_peers" not in tables.get("network", {}):
        tables.setdefault("network", {})["initial_peers"] = list(spec.bootstrap)
    return build_config(tables)


def _digest(signed_bytes: bytes) -> bytes:
    return hashlib.sha256(signed_bytes).digest()


def bad_signature(creator: str) -> str:
    return (
        "signature does not verify: the file was changed after it was signed, "
        f"or was not signed by {creator}"
    )


def bootstrap_problem(maddr: Any) -> str | None:
    if isinstance(maddr, str) and maddr.startswith("/") and not any(c.isspace() for c in maddr):
        host, sep, peer = maddr.rpartition("/p2p/")
        if sep and host and is_peer_id(peer):
            return None
    return (
        f"bootstrap address {maddr!r} is not a multiaddr ending in /p2p/<peer id>, "
        "e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
    )
