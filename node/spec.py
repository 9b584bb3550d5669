"""The signed run spec: the settings every node of a run shares, fixed once by its creator.

A bootstrap operator runs ``atoll spec create`` once: it takes the shared settings
(:data:`SHARED_KEYS`) from a config, adds the round clock's start ``t0`` and the
bootstrap multiaddrs, signs them with the operator's Ed25519 key and writes a TOML
file. Volunteers join with ``atoll run --spec FILE``: :func:`read_spec` checks the
file and its signature, and :func:`apply_spec` lays the shared settings over the
node's own config, refusing any local value that differs, so no node trains another
model, codec or clock by accident. Nodes announce :attr:`RunSpec.digest` (or, when
started without a spec, :func:`settings_digest`) so peers on other settings are told
apart before they exchange anything::

    signed_bytes = msgpack({version, run_id, protocol, creator, created, t0,
                            bootstrap, shared})          # keys sorted at every level
    digest       = sha256(signed_bytes)
    signature    = Ed25519(creator's key, b"atoll/spec/v1\\0" + digest)
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgpack
import tomli_w

from node.config import AtollConfig, ConfigError, build_config
from node.shared_settings import (
    SHARED_KEYS,
    canonical,
    same_value,
    settings_digest,
    shared_settings,
)
from protocol.wire.messages import PROTOCOL_VERSION
from verification.files import atomic_write
from verification.identity import Identity, verify
from verification.policy import is_peer_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "SHARED_KEYS",
    "SPEC_VERSION",
    "RunSpec",
    "SpecError",
    "apply_spec",
    "create_spec",
    "parse_spec",
    "read_spec",
    "settings_digest",
    "spec_text",
    "write_spec",
]

SPEC_VERSION = 1
"""Layout version of the spec file and of :meth:`RunSpec.signed_bytes`."""


_SIGN_DOMAIN = b"atoll/spec/v1\0"
_SIGNATURE_LEN = 64
_T0_LEAD_SECONDS = 60.0
_HEAD_KEYS = ("version", "run_id", "protocol", "creator", "created", "t0", "bootstrap", "signature")


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
    """

    run_id: str
    protocol: int
    creator: str
    created: str
    t0: float | None
    bootstrap: tuple[str, ...]
    shared: dict[str, dict[str, Any]]
    signature: bytes

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
        return msgpack.packb(canonical(fields), use_bin_type=True)

    @property
    def digest(self) -> str:
        """Hex SHA-256 of :meth:`signed_bytes`: what nodes announce to find peers on another spec."""
        return hashlib.sha256(self.signed_bytes()).hexdigest()

    @property
    def short(self) -> str:
        """The first 12 hex characters of :attr:`digest`, for messages."""
        return self.digest[:12]

    def verify(self) -> None:
        """Check the creator's signature.

        Raises:
            SpecError: if the signature is not ``creator``'s over these fields.
        """
        if not self._signature_ok():
            raise SpecError(f"run spec {self.short}: {_bad_signature(self.creator)}")

    def _signature_ok(self) -> bool:
        return verify(self.creator, _signing_payload(self.signed_bytes()), self.signature)


def create_spec(
    cfg: AtollConfig,
    identity: Identity,
    bootstrap: Sequence[str] = (),
    t0: float | None = None,
    now: float | None = None,
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

    Raises:
        SpecError: a bootstrap entry that is not a ``/p2p/`` multiaddr, or a ``t0``
            that is not finite or is given for the ``steps`` trigger.
    """
    now = time.time() if now is None else float(now)
    peers = tuple(bootstrap)
    for maddr in peers:
        problem = _bootstrap_problem(maddr)
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
    )
    signature = identity.sign(_signing_payload(unsigned.signed_bytes()))
    return dataclasses.replace(unsigned, signature=signature)


def spec_text(spec: RunSpec, name: str = "run.toml") -> str:
    """The spec file's text: a comment header (its join and check commands naming the
    file ``name``), the signed head and the shared settings, as TOML."""
    head: dict[str, Any] = {
        "version": SPEC_VERSION,
        "run_id": spec.run_id,
        "protocol": spec.protocol,
        "creator": spec.creator,
        "created": spec.created,
    }
    if spec.t0 is not None:
        head["t0"] = spec.t0
    head["bootstrap"] = list(spec.bootstrap)
    head["signature"] = base64.b64encode(spec.signature).decode("ascii")
    name = shlex.quote(name)
    header = (
        f"# Atoll run spec for run {spec.run_id!r} (spec {spec.short}): the settings every\n"
        f"# node of the run shares, signed by its creator {spec.creator}.\n"
        f"# Join the run:    atoll run --spec {name} --operator {spec.creator}\n"
        f"# Check the file:  atoll spec show {name}\n"
        "# Any edit breaks the signature; to change a setting, create a new spec.\n\n"
    )
    return header + tomli_w.dumps({"spec": head, "shared": spec.shared})


def write_spec(spec: RunSpec, path: str | Path, *, force: bool = False) -> None:
    """Write ``spec`` as TOML (:func:`spec_text`), atomically (:func:`verification.files.atomic_write`).

    Raises:
        SpecError: if ``path`` exists and ``force`` is false, or it cannot be written.
    """
    path = Path(path)
    text = spec_text(spec, path.name)
    try:
        atomic_write(path, text, perms=0o644, prefix=f".{path.name}.{os.getpid()}.", replace=force)
    except FileExistsError:
        raise SpecError(f"run spec {path}: already exists (use --force to replace it)") from None
    except OSError as exc:
        raise SpecError(f"run spec {path}: cannot write: {exc.strerror or exc}") from None


def read_spec(path: str | Path, operator: str | None = None) -> RunSpec:
    """Read and verify a spec file.

    Args:
        path: the file.
        operator: the PeerID of the run's operator, as the volunteer got it from the
            operator (``atoll run --operator``): a spec signed by any other key is
            refused, however valid its signature. None trusts whoever signed it.

    Raises:
        SpecError: one line naming the file and the problem: missing, unreadable,
            not TOML, wrong version, a missing or mistyped field, an unknown shared
            key, a bad signature, a signer other than ``operator``, another protocol
            version or invalid settings.
    """
    path = Path(path)
    _check_operator(operator)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(
            f"run spec {path}: no such file (a run's creator makes one with `atoll spec create`)"
        ) from None
    except OSError as exc:
        raise SpecError(f"run spec {path}: cannot read: {exc.strerror or exc}") from None
    return parse_spec(data, f"run spec {path}", operator)


def parse_spec(data: bytes, source: str, operator: str | None = None) -> RunSpec:
    """Parse and verify a spec file's bytes (from a file, or from a peer that serves its
    run's spec); the checks are :func:`read_spec`'s.

    Args:
        data: the file's bytes.
        source: what the bytes are, for the error (``run spec run.toml``, ``the run
            spec from 12D3KooW...``).
        operator: as in :func:`read_spec`.

    Raises:
        SpecError: as :func:`read_spec`, beginning with ``source``.
    """
    _check_operator(operator)

    def fail(problem: str) -> SpecError:
        return SpecError(f"{source}: {problem}")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise fail("not UTF-8 text, so not a run spec") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise fail(f"not TOML: {' '.join(str(exc).split())}") from None
    spec = _parse(doc, fail)
    if not spec._signature_ok():
        raise fail(_bad_signature(spec.creator))
    if operator is not None and spec.creator != operator:
        raise fail(
            f"signed by {spec.creator}, not by the operator {operator}: a copy of run "
            f"{spec.run_id!r} by someone else (its settings and peers are theirs); get the "
            "spec from the operator"
        )
    if spec.protocol != PROTOCOL_VERSION:
        raise fail(
            f"the run speaks protocol {spec.protocol}, this atoll speaks {PROTOCOL_VERSION}: "
            f"use an atoll release that speaks protocol {spec.protocol}"
        )
    try:
        cfg = build_config(spec.shared)
    except ConfigError as exc:
        raise fail(f"shared settings do not validate: {str(exc).splitlines()[0]}") from None
    if cfg.run.run_id != spec.run_id:
        raise fail(f"spec.run_id {spec.run_id!r} differs from shared.run.run_id")
    if (spec.t0 is None) != (cfg.sync.trigger == "steps"):
        raise fail(
            f"spec.t0 must be set exactly when sync.trigger = 'seconds' (here {cfg.sync.trigger!r})"
        )
    return spec


def _check_operator(operator: str | None) -> None:
    if operator is not None and not is_peer_id(operator):
        raise SpecError(f"--operator {operator!r}: not a PeerID (12D3KooW..., from the operator)")


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


def _signing_payload(signed_bytes: bytes) -> bytes:
    # The domain tag keeps a spec signature from ever passing for another signed thing.
    return _SIGN_DOMAIN + hashlib.sha256(signed_bytes).digest()


def _bad_signature(creator: str) -> str:
    return (
        "signature does not verify: the file was changed after it was signed, "
        f"or was not signed by {creator}"
    )


def _bootstrap_problem(maddr: Any) -> str | None:
    if isinstance(maddr, str) and maddr.startswith("/") and not any(c.isspace() for c in maddr):
        host, sep, peer = maddr.rpartition("/p2p/")
        if sep and host and is_peer_id(peer):
            return None
    return (
        f"bootstrap address {maddr!r} is not a multiaddr ending in /p2p/<peer id>, "
        "e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
    )


def _parse(doc: dict[str, Any], fail: Callable[[str], SpecError]) -> RunSpec:
    """Check a spec document's layout and field types; the signature is checked after."""
    for table in doc:
        if table not in ("spec", "shared"):
            raise fail(f"unknown table [{table}]: a run spec has only [spec] and [shared.*]")
    head = doc.get("spec")
    if not isinstance(head, dict):
        raise fail("no [spec] table, so not an Atoll run spec")
    version = head.get("version")
    if type(version) is not int or version != SPEC_VERSION:
        later = type(version) is int and version > SPEC_VERSION
        raise fail(
            f"spec.version = {version!r}: this atoll reads version {SPEC_VERSION}"
            + ("; upgrade atoll" if later else "")
        )
    for key in head:
        if key not in _HEAD_KEYS:
            raise fail(f"unknown key spec.{key}")

    def field(key: str, kind: type, what: str) -> Any:
        if key not in head:
            raise fail(f"spec.{key} is missing")
        value = head[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise fail(f"spec.{key} = {value!r}: expected {what}")
        return value

    creator = field("creator", str, "a PeerID")
    if not is_peer_id(creator):
        raise fail(f"spec.creator = {creator!r}: expected a PeerID (12D3KooW...)")
    t0 = head.get("t0")
    if t0 is not None and (not isinstance(t0, (int, float)) or isinstance(t0, bool)):
        raise fail(f"spec.t0 = {t0!r}: expected a unix time")
    bootstrap = field("bootstrap", list, "a list of multiaddrs")
    for maddr in bootstrap:
        problem = _bootstrap_problem(maddr)
        if problem:
            raise fail(f"spec.bootstrap: {problem}")
    try:
        signature = base64.b64decode(field("signature", str, "base64 text"), validate=True)
    except binascii.Error:
        raise fail("spec.signature is not valid base64") from None
    if len(signature) != _SIGNATURE_LEN:
        raise fail(f"spec.signature is {len(signature)} bytes, expected {_SIGNATURE_LEN}")
    return RunSpec(
        run_id=field("run_id", str, "a string"),
        protocol=field("protocol", int, "an integer"),
        creator=creator,
        created=field("created", str, "an ISO-8601 time"),
        t0=None if t0 is None else float(t0),
        bootstrap=tuple(bootstrap),
        shared=_parse_shared(doc.get("shared"), fail),
        signature=signature,
    )


def _parse_shared(shared: Any, fail: Callable[[str], SpecError]) -> dict[str, dict[str, Any]]:
    if not isinstance(shared, dict):
        raise fail("no [shared.*] tables: the spec carries no settings")
    for section, values in shared.items():
        if section not in SHARED_KEYS:
            raise fail(f"[shared.{section}]: {section} has no shared settings")
        if not isinstance(values, dict):
            raise fail(f"shared.{section} must be a table")
        for key in values:
            if key not in SHARED_KEYS[section]:
                raise fail(f"shared.{section}.{key} is not a setting a run shares")
    for section, keys in SHARED_KEYS.items():
        for key in keys:
            if key not in shared.get(section, {}):
                raise fail(
                    f"shared.{section}.{key} is missing (a spec made by another atoll "
                    "release: make it again with `atoll spec create`)"
                )
    return {
        section: {key: canonical(shared[section][key]) for key in keys}
        for section, keys in SHARED_KEYS.items()
    }
