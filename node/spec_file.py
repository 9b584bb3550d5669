"""A run spec as a file: its TOML text, writing and reading it, and the checks that
decide whether a spec is trusted (:mod:`node.spec` holds the spec itself).

A spec file holds a ``[spec]`` table (the signed head: version, run id, protocol,
creator, created, ``t0``, bootstrap, the previous version where there is one, and the
signature, base64) and the ``[shared.*]`` tables of settings. Reading one checks its
layout, every signature down its chain of versions, who signed each version, the
operator pin, the protocol and that the settings validate; any failure is one line
naming the file.
"""

from __future__ import annotations

import base64
import binascii
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from node.config import ConfigError, build_config
from node.shared_settings import SHARED_KEYS, canonical
from node.spec import (
    HEAD_KEYS,
    MAX_VERSIONS,
    SIGNATURE_LEN,
    SPEC_VERSION,
    RunSpec,
    SpecError,
    bad_signature,
    bootstrap_problem,
)
from protocol.wire.messages import PROTOCOL_VERSION
from verification.files import atomic_write
from verification.policy import is_peer_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["parse_spec", "read_spec", "spec_text", "write_spec"]


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
    if spec.previous is not None:
        head["previous"] = base64.b64encode(spec.previous).decode("ascii")
    head["signature"] = base64.b64encode(spec.signature).decode("ascii")
    chain = spec.chain()
    version = ""
    if len(chain) > 1:
        before = chain[1]
        version = (
            f"# Version {len(chain)} of the run's spec: it replaces spec {before.short} "
            f"by {before.creator}.\n"
        )
    name = shlex.quote(name)
    header = (
        f"# Atoll run spec for run {spec.run_id!r} (spec {spec.short}): the settings every\n"
        f"# node of the run shares, signed by its creator {spec.creator}.\n"
        f"{version}"
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
        raise fail(bad_signature(spec.creator))
    chain = _checked_chain(spec, fail)
    if operator is not None and operator not in {version.creator for version in chain}:
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


def _checked_chain(spec: RunSpec, fail: Callable[[str], SpecError]) -> list[RunSpec]:
    """``spec``'s versions, newest first, each signed by a signer the one before it
    named, all of one run (see the module docstring)."""
    try:
        chain = spec.chain()
    except SpecError as exc:
        raise fail(str(exc)) from None
    if len(chain) > MAX_VERSIONS:
        raise fail(f"more than {MAX_VERSIONS} versions")
    for newer, older in zip(chain, chain[1:]):
        if not older._signature_ok():
            raise fail(f"its previous version {older.short}: {bad_signature(older.creator)}")
        if older.run_id != newer.run_id:
            raise fail(
                f"version {newer.short} of run {newer.run_id!r} replaces a version of run "
                f"{older.run_id!r}"
            )
        if newer.creator not in older.signers:
            raise fail(
                f"version {newer.short} is signed by {newer.creator}, whom its previous "
                f"version {older.short} does not name as a signer ({', '.join(older.signers)}):"
                " not a version of the run by its operator"
            )
    return chain


def _check_operator(operator: str | None) -> None:
    if operator is not None and not is_peer_id(operator):
        raise SpecError(f"--operator {operator!r}: not a PeerID (12D3KooW..., from the operator)")


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
        if key not in HEAD_KEYS:
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
        problem = bootstrap_problem(maddr)
        if problem:
            raise fail(f"spec.bootstrap: {problem}")
    try:
        signature = base64.b64decode(field("signature", str, "base64 text"), validate=True)
    except binascii.Error:
        raise fail("spec.signature is not valid base64") from None
    if len(signature) != SIGNATURE_LEN:
        raise fail(f"spec.signature is {len(signature)} bytes, expected {SIGNATURE_LEN}")
    previous = None
    if "previous" in head:
        try:
            previous = base64.b64decode(field("previous", str, "base64 text"), validate=True)
        except binascii.Error:
            raise fail("spec.previous is not valid base64") from None
    return RunSpec(
        run_id=field("run_id", str, "a string"),
        protocol=field("protocol", int, "an integer"),
        creator=creator,
        created=field("created", str, "an ISO-8601 time"),
        t0=None if t0 is None else float(t0),
        bootstrap=tuple(bootstrap),
        shared=_parse_shared(doc.get("shared"), fail),
        signature=signature,
        previous=previous,
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
