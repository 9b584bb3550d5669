"""The signed run spec: shared keys, file round trip, signature, apply_spec and the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import stat
import sys
import types
from pathlib import Path

import pytest

from node.cli import main
from node.config import AtollConfig, ConfigError, load_config
from node.spec import (
    SHARED_KEYS,
    RunSpec,
    SpecError,
    apply_spec,
    create_spec,
    settings_digest,
    spec_changes,
)
from node.spec_file import read_spec, write_spec
from verification.identity import Identity

ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
BOOT = f"/ip4/203.0.113.7/tcp/31337/p2p/{ALICE.peer_id}"
NOW = 1_000.0  # 1970-01-01T00:16:40Z


def _cfg(*overrides: str) -> AtollConfig:
    return load_config(None, list(overrides))


def _spec(*overrides: str, **kwargs) -> RunSpec:
    base = ("sync.codec='int8'", "sync.round_seconds=30.0", "outer.lr=0.30000000000000004")
    return create_spec(_cfg(*base, *overrides), ALICE, now=NOW, **kwargs)


def _written(tmp_path: Path, spec: RunSpec | None = None) -> Path:
    path = tmp_path / "run.toml"
    write_spec(spec or _spec(bootstrap=[BOOT]), path)
    return path


def _one_line(text: str) -> str:
    assert text.strip() and "\n" not in text.strip(), text
    return text.strip()


# --- which keys are shared ----------------------------------------------------------------


def test_every_shared_key_is_a_config_key() -> None:
    sections = {f.name: f for f in dataclasses.fields(AtollConfig)}
    cfg = AtollConfig()
    for section, keys in SHARED_KEYS.items():
        assert section in sections, section
        names = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        missing = set(keys) - names
        assert not missing, f"{section}: {sorted(missing)} are not config keys"
    # every model key but the two local paths, whose contents are bound by digest
    model_keys = {f.name for f in dataclasses.fields(cfg.model)}
    assert set(SHARED_KEYS["model"]) == model_keys - {"hf_config", "init_from"}
    assert {"config_digest", "init_digest"} <= set(SHARED_KEYS["model"])
    assert SHARED_KEYS["data"] == ("tokenizer_digest", "dataset_digest")
    assert set(SHARED_KEYS["outer"]) == {f.name for f in dataclasses.fields(cfg.outer)}
    assert "tau" not in SHARED_KEYS["sync"] and "alpha" not in SHARED_KEYS["sync"]
    # a topk part is refused unless it keeps the run's count of the run's chunk in its bits
    assert {"topk_chunk", "topk_density", "topk_bits"} <= set(SHARED_KEYS["sync"])
    assert SHARED_KEYS["run"] == ("run_id", "seed", "spec_signers")


# --- create / write / read ----------------------------------------------------------------


def test_round_trip_keeps_every_field_and_floats_exact(tmp_path: Path) -> None:
    t0 = 1_700_000_000.1234567
    spec = _spec(bootstrap=[BOOT], t0=t0)
    path = _written(tmp_path, spec)
    back = read_spec(path)
    assert back == spec  # every field, the shared dict and the signature bytes
    assert back.digest == spec.digest and len(back.digest) == 64
    assert back.short == spec.digest[:12]
    assert back.t0 == t0  # exact, not approximately
    assert back.shared["outer"]["lr"] == 0.1 + 0.2
    assert back.shared["sync"]["round_seconds"] == 30.0
    assert back.bootstrap == (BOOT,) and back.creator == ALICE.peer_id
    assert back.created == "1970-01-01T00:16:40Z"
    back.verify()


def test_file_layout_and_header(tmp_path: Path) -> None:
    text = _written(tmp_path).read_text()
    assert text.startswith("# Atoll run spec")
    assert "atoll run --spec run.toml" in text
    for table in ("[spec]", "[shared.run]", "[shared.model]", "[shared.sync]", "[shared.trust]"):
        assert f"\n{table}\n" in text, table
    assert re.search(r"^t0 = 1080\.0$", text, re.M)
    assert re.search(r'^codec = "int8"$', text, re.M)
    assert "tau" not in text and "data_dir" not in text


def test_default_t0_is_a_round_boundary_a_minute_ahead() -> None:
    # ceil((1000 + 60) / 30) * 30 = 36 * 30 = 1080
    assert _spec().t0 == 1080.0
    assert _spec("sync.round_seconds=7.0").t0 == 1064.0  # ceil(1060 / 7) = 152; 152 * 7
    assert _spec(t0=5000.5).t0 == 5000.5
    assert _spec("sync.trigger='steps'").t0 is None
    with pytest.raises(SpecError, match="only for sync.trigger = 'seconds'"):
        _spec("sync.trigger='steps'", t0=5000.0)


@pytest.mark.parametrize(
    "pattern, replacement",
    [
        (r'^codec = "int8"$', 'codec = "int4"'),
        (r"^n_layer = 2$", "n_layer = 3"),
        (r"^lr = 0\.30000000000000004$", "lr = 0.3"),
        (r"^t0 = 1080\.0$", "t0 = 1081.0"),
        (r"^aggregator = \"mean\"$", 'aggregator = "median"'),
        (r"^created = .*$", 'created = "2030-01-01T00:00:00Z"'),
    ],
)
def test_tampering_breaks_the_signature(tmp_path: Path, pattern: str, replacement: str) -> None:
    path = _written(tmp_path)
    text, count = re.subn(pattern, replacement, path.read_text(), flags=re.M)
    assert count == 1
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        read_spec(path)
    message = _one_line(str(info.value))
    assert message == (
        f"run spec {path}: signature does not verify: the file was changed after it was "
        f"signed, or was not signed by {ALICE.peer_id}"
    )


def test_a_spec_claiming_another_creator_fails(tmp_path: Path) -> None:
    forged = dataclasses.replace(_spec(), creator=BOB.peer_id)  # signed by ALICE
    with pytest.raises(SpecError, match=f"not signed by {BOB.peer_id}"):
        forged.verify()
    path = _written(tmp_path, forged)
    with pytest.raises(SpecError, match=f"signature does not verify.*{BOB.peer_id}"):
        read_spec(path)


def test_a_pinned_operator_refuses_a_copy_signed_by_anyone_else(tmp_path: Path) -> None:
    # A stranger's copy of the run: the same run id, a valid signature, their settings.
    stranger = create_spec(_cfg("sync.codec='int8'", "run.run_id='atoll-local'"), BOB, now=NOW)
    path = _written(tmp_path, stranger)
    assert read_spec(path) == stranger  # unpinned, whoever signed it is trusted
    with pytest.raises(SpecError) as refused:
        read_spec(path, operator=ALICE.peer_id)
    line = _one_line(str(refused.value))
    assert f"signed by {BOB.peer_id}, not by the operator {ALICE.peer_id}" in line
    assert str(path) in line and "'atoll-local'" in line
    # the operator's own spec passes the pin
    (tmp_path / "mine").mkdir()
    mine = _written(tmp_path / "mine")
    assert read_spec(mine, operator=ALICE.peer_id).creator == ALICE.peer_id
    with pytest.raises(SpecError, match="--operator 'alice': not a PeerID"):
        read_spec(mine, operator="alice")


def test_another_protocol_version_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("node.spec.PROTOCOL_VERSION", 2)
    spec = _spec()
    monkeypatch.undo()
    with pytest.raises(SpecError, match="protocol 2, this atoll speaks 1"):
        read_spec(_written(tmp_path, spec))


def test_bad_bootstrap_is_a_clear_error() -> None:
    with pytest.raises(SpecError, match=r"'/ip4/1\.2\.3\.4/tcp/1'.*/p2p/<peer id>"):
        _spec(bootstrap=["/ip4/1.2.3.4/tcp/1"])
    with pytest.raises(SpecError, match="not a multiaddr"):
        _spec(bootstrap=["1.2.3.4:31337"])


def test_write_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    path = _written(tmp_path)
    with pytest.raises(SpecError, match="already exists"):
        write_spec(_spec("run.seed=1"), path)
    assert read_spec(path).shared["run"]["seed"] == 0
    write_spec(_spec("run.seed=1"), path, force=True)
    assert read_spec(path).shared["run"]["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]  # no temporary left


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda t: "[sync\n" + t, "not TOML"),
        (lambda t: t.replace("[spec]", "[header]"), "unknown table [header]"),
        (lambda t: re.sub(r"^version = 1$", "version = 2", t, flags=re.M), "version = 2"),
        (lambda t: re.sub(r"^version = 1$", "", t, flags=re.M), "spec.version = None"),
        (lambda t: re.sub(r"^run_id = .*$", "", t, count=1, flags=re.M), "spec.run_id is missing"),
        (lambda t: re.sub(r"^protocol = 1$", 'protocol = "1"', t, flags=re.M), "spec.protocol"),
        (lambda t: t.replace("[shared.sync]\n", "[shared.sync]\ntau = 3\n"), "shared.sync.tau"),
        (lambda t: t.replace("[shared.sync]\n", "[shared.sync]\nnope = 1\n"), "shared.sync.nope"),
        (lambda t: re.sub(r"^signature = .*$", 'signature = "%%"', t, flags=re.M), "base64"),
    ],
)
def test_malformed_specs_are_one_line_errors(tmp_path: Path, edit, fragment: str) -> None:
    path = _written(tmp_path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(SpecError) as info:
        read_spec(path)
    message = _one_line(str(info.value))
    assert message.startswith(f"run spec {path}: ") and fragment in message


def test_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        read_spec(tmp_path / "nope.toml")
    assert _one_line(str(info.value)).startswith(f"run spec {tmp_path / 'nope.toml'}: no such file")


# --- apply_spec ---------------------------------------------------------------------------


def test_apply_spec_refuses_a_differing_shared_key() -> None:
    spec = _spec()
    with pytest.raises(ConfigError) as info:
        apply_spec(spec, {"sync": {"codec": "int4"}})
    assert str(info.value) == (
        f"config error: sync.codec = 'int4' differs from the run spec's 'int8' "
        f"(run spec {spec.short}); shared settings come from the spec: remove the key "
        "from your config"
    )
    with pytest.raises(ConfigError, match=r"run\.seed = 7 .*, model\.n_layer = 4 .*these keys"):
        apply_spec(spec, {"model": {"n_layer": 4}, "run": {"seed": 7}})
    # nodes on another registry or grid never see or meet the run's other nodes
    for key, value in (("registry_shards", 4), ("cells_above", 64)):
        with pytest.raises(ConfigError, match=rf"network\.{key} = {value} differs"):
            apply_spec(spec, {"network": {key: value}})


def test_apply_spec_accepts_equal_and_absent_keys() -> None:
    spec = _spec("sync.round_seconds=20.0")
    local = {"sync": {"round_seconds": 20, "codec": "int8", "tau": 3}, "train": {"lr": 1e-4}}
    cfg = apply_spec(spec, local)
    assert cfg.sync.round_seconds == 20.0 and cfg.sync.codec == "int8"
    assert cfg.outer.lr == 0.1 + 0.2  # absent locally: the spec's value
    assert cfg.sync.tau == 3 and cfg.train.lr == 1e-4  # local keys stay local
    with pytest.raises(ConfigError, match="unknown key 'sync.nope'"):
        apply_spec(spec, {"sync": {"nope": 1}})


def test_bootstrap_becomes_initial_peers_unless_set_locally() -> None:
    spec = _spec(bootstrap=[BOOT])
    assert apply_spec(spec, {}).network.initial_peers == (BOOT,)
    own = f"/ip4/198.51.100.1/tcp/1/p2p/{BOB.peer_id}"
    assert apply_spec(spec, {"network": {"initial_peers": [own]}}).network.initial_peers == (own,)


# --- settings_digest ----------------------------------------------------------------------


def test_settings_digest_follows_shared_keys_only() -> None:
    base = settings_digest(_cfg())
    assert base == settings_digest(_cfg()) and len(base) == 64
    for shared in ("sync.codec='int8'", "model.n_layer=3", "run.seed=1", "outer.lr=0.5"):
        assert settings_digest(_cfg(shared)) != base, shared
    for local in ("train.lr=1e-4", "run.data_dir='/tmp/x'", "sync.tau=2", "network.port=9"):
        assert settings_digest(_cfg(local)) == base, local


# --- the CLI ------------------------------------------------------------------------------


def _fake_daemon(monkeypatch) -> list[dict]:
    """Stand in for node.daemon so no node starts; records each Node construction."""
    calls: list[dict] = []

    class Node:
        def __init__(self, cfg, **kwargs) -> None:
            calls.append({"cfg": cfg, **kwargs})

        def run(self) -> int:
            return 0

    module = types.ModuleType("node.daemon")
    module.Node = Node
    monkeypatch.setitem(sys.modules, "node.daemon", module)
    return calls


def _create(tmp_path: Path, *extra: str) -> list[str]:
    config = tmp_path / "run-config.toml"
    config.write_text('[run]\nrun_id = "cli-run"\n[sync]\ncodec = "int8"\n')
    return [
        "spec",
        "create",
        "--config",
        str(config),
        "--data-dir",
        str(tmp_path / "node"),
        "--bootstrap",
        BOOT,
        "--t0",
        "2000000000",
        "--out",
        str(tmp_path / "run.toml"),
        *extra,
    ]


def test_cli_spec_create_and_show(tmp_path: Path, capsys) -> None:
    assert main(_create(tmp_path)) == 0
    out = capsys.readouterr().out
    key = tmp_path / "node" / "identity.key"
    peer = Identity.load(key).peer_id
    spec = read_spec(tmp_path / "run.toml")
    assert f"wrote {tmp_path / 'run.toml'}: run cli-run, spec {spec.short}, creator {peer}" in out
    assert f"atoll run --spec {tmp_path / 'run.toml'}" in out
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert spec.t0 == 2_000_000_000.0 and spec.bootstrap == (BOOT,)

    assert main(["spec", "show", str(tmp_path / "run.toml")]) == 0
    out = capsys.readouterr().out
    assert "signature OK" in out and spec.digest in out and peer in out
    assert 'sync.codec = "int8"' in out and BOOT in out

    assert main(["spec", "show", "--json", str(tmp_path / "run.toml")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["digest"] == spec.digest and shown["shared"]["run"]["run_id"] == "cli-run"

    assert main(_create(tmp_path)) == 2  # exists, no --force
    assert "already exists" in _one_line(capsys.readouterr().err)
    assert main(_create(tmp_path, "--force")) == 0


def test_cli_run_with_spec_passes_it_to_the_node(tmp_path: Path, monkeypatch, capsys) -> None:
    assert main(_create(tmp_path)) == 0
    calls = _fake_daemon(monkeypatch)
    local = tmp_path / "local.toml"
    local.write_text('[sync]\ncodec = "int8"\ntau = 2\n')
    args = ["run", "--spec", str(tmp_path / "run.toml"), "--config", str(local)]
    assert main(args) == 0
    (call,) = calls
    assert call["spec"] == read_spec(tmp_path / "run.toml")
    assert call["cfg"].run.run_id == "cli-run" and call["cfg"].sync.tau == 2
    assert call["cfg"].network.initial_peers == (BOOT,)


def test_cli_run_with_a_differing_shared_key_fails_before_any_node(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    assert main(_create(tmp_path)) == 0
    capsys.readouterr()
    calls = _fake_daemon(monkeypatch)
    args = ["run", "--spec", str(tmp_path / "run.toml"), "--set", "sync.codec='int4'"]
    assert main(args) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("atoll: config error: sync.codec = 'int4' differs")
    assert calls == []


def test_cli_run_refuses_a_spec_not_signed_by_the_operator(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    assert main(_create(tmp_path)) == 0
    creator = read_spec(tmp_path / "run.toml").creator
    assert f"--operator {creator}" in capsys.readouterr().out
    calls = _fake_daemon(monkeypatch)
    spec = str(tmp_path / "run.toml")
    assert main(["run", "--spec", spec, "--operator", BOB.peer_id]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"signed by {creator}, not by the operator {BOB.peer_id}" in err
    assert main(["run", "--operator", creator]) == 2
    assert "give the spec with --spec FILE" in _one_line(capsys.readouterr().err)
    assert calls == []
    assert main(["run", "--spec", spec, "--operator", creator]) == 0
    assert len(calls) == 1 and calls[0]["spec"].creator == creator


@pytest.mark.parametrize("content", [None, "[spec\nversion = 1\n"])
def test_cli_bad_spec_file_is_one_line(tmp_path: Path, capsys, content: str | None) -> None:
    path = tmp_path / "run.toml"
    if content is not None:
        path.write_text(content)
    assert main(["spec", "show", str(path)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"atoll: run spec {path}: ")
    assert ("not TOML" if content else "no such file") in err


def test_cli_bootstrap_without_peer_id_is_the_creators_own_address(tmp_path: Path, capsys) -> None:
    args = _create(tmp_path)
    args[args.index(BOOT)] = "/ip4/203.0.113.5/tcp/31337"
    assert main(args) == 0
    peer = Identity.load(tmp_path / "node" / "identity.key").peer_id
    spec = read_spec(tmp_path / "run.toml")
    assert spec.bootstrap == (f"/ip4/203.0.113.5/tcp/31337/p2p/{peer}",)


# --- versions ------------------------------------------------------------------------------

CAROL = Identity.from_seed(b"c" * 32)


def _versions() -> tuple[RunSpec, RunSpec]:
    """Alice's first spec names Bob as a signer; Bob signs the second, with another lr."""
    first = _spec(f"run.spec_signers=['{BOB.peer_id}']", bootstrap=[BOOT])
    cfg = _cfg(
        "sync.codec='int8'",
        "sync.round_seconds=30.0",
        "outer.lr=0.5",
        f"run.spec_signers=['{BOB.peer_id}']",
    )
    return first, create_spec(cfg, BOB, bootstrap=[BOOT], now=NOW + 60, previous=first)


def test_a_rotated_signer_is_accepted_under_the_operators_pin(tmp_path: Path) -> None:
    first, second = _versions()
    path = _written(tmp_path, second)
    read = read_spec(path, operator=ALICE.peer_id)  # the pin the volunteers hold
    assert read.creator == BOB.peer_id and read.digest == second.digest
    assert [v.digest for v in read.chain()] == [second.digest, first.digest]
    assert read_spec(path, operator=BOB.peer_id).digest == second.digest  # the new key's pin
    with pytest.raises(SpecError, match=f"not by the operator {CAROL.peer_id}"):
        read_spec(path, operator=CAROL.peer_id)
    assert spec_changes(first, second) == ["outer.lr: 0.30000000000000004 -> 0.5"]
    assert "Version 2 of the run's spec" in path.read_text() and first.short in path.read_text()
    assert first.digest != second.digest and first.t0 == second.t0
    from node.swarm.join import run_addresses

    # Bob signed it, but the bootstrap node is still Alice's: its address pins her key
    assert [str(a) for a in run_addresses(second)] == [f"{second.run_id}@{BOOT}"]


def test_a_version_by_a_key_the_previous_does_not_name_is_refused(tmp_path: Path) -> None:
    first, _ = _versions()
    # the creator may refuse to sign for a stranger, but a stranger signs anyway
    with pytest.raises(SpecError, match=f"key {CAROL.peer_id} may not sign a version"):
        create_spec(_cfg("outer.lr=0.5"), CAROL, now=NOW, previous=first)
    forged = dataclasses.replace(
        _spec("outer.lr=0.9"), creator=CAROL.peer_id, previous=_pack(first)
    )
    forged = dataclasses.replace(forged, signature=_sign(CAROL, forged))
    path = _written(tmp_path, forged)
    line = _one_line(_raises(lambda: read_spec(path, operator=ALICE.peer_id)))
    assert f"signed by {CAROL.peer_id}, whom its previous version {first.short}" in line
    # also without a pin: a version is the run's only if its signer was named
    assert "does not name as a signer" in _raises(lambda: read_spec(path))


def test_a_version_of_another_run_or_a_tampered_previous_is_refused(tmp_path: Path) -> None:
    first, second = _versions()
    with pytest.raises(SpecError, match="a new version keeps its run's id"):
        create_spec(_cfg("run.run_id='other'"), BOB, now=NOW, previous=first)
    other = dataclasses.replace(first, run_id="other")
    moved = dataclasses.replace(second, previous=_pack(other))
    moved = dataclasses.replace(moved, signature=_sign(BOB, moved))
    assert "signature does not verify" in _raises(lambda: read_spec(_written(tmp_path, moved)))
    (tmp_path / "other").mkdir()
    theirs = create_spec(_cfg("run.run_id='other'", f"run.spec_signers=['{BOB.peer_id}']"), ALICE)
    crossed = dataclasses.replace(second, previous=_pack(theirs))
    crossed = dataclasses.replace(crossed, signature=_sign(BOB, crossed))
    text = _raises(lambda: read_spec(_written(tmp_path / "other", crossed)))
    assert "replaces a version of run 'other'" in text
    (tmp_path / "junk").mkdir()
    junk = dataclasses.replace(second, previous=b"\x93\x01\x02\x03")
    junk = dataclasses.replace(junk, signature=_sign(BOB, junk))
    text = _raises(lambda: read_spec(_written(tmp_path / "junk", junk)))
    assert "spec.previous is not a packed run spec" in text


def test_the_cli_makes_a_version_and_the_node_says_what_changed(
    tmp_path: Path, capsys, caplog
) -> None:
    first, _ = _versions()
    old = _written(tmp_path, first)
    bob = tmp_path / "bob.key"
    BOB.save(bob)
    config = tmp_path / "next.toml"
    config.write_text(
        '[run]\nspec_signers = ["' + BOB.peer_id + '"]\n'
        "[sync]\ncodec = 'int8'\nround_seconds = 30.0\n[outer]\nlr = 0.5\n"
    )
    out = tmp_path / "v2.toml"
    args = ["spec", "create", "--config", str(config), "--key", str(bob), "--out", str(out)]
    assert main([*args, "--previous", str(old)]) == 0
    printed = capsys.readouterr().out
    assert f"replaces spec {first.short}" in printed and "outer.lr: " in printed
    new = read_spec(out, operator=ALICE.peer_id)
    assert new.chain()[1].digest == first.digest and new.t0 == first.t0
    assert main(["spec", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"version\s+2;", shown) and f"replaces   spec {first.short}" in shown
    # a key the previous version does not name: one line, exit 2
    CAROL.save(tmp_path / "carol.key")
    args[args.index(str(bob))] = str(tmp_path / "carol.key")
    assert main([*args, "--previous", str(old), "--force"]) == 2
    assert "may not sign a version" in capsys.readouterr().err


def _pack(spec: RunSpec) -> bytes:
    import msgpack

    return msgpack.packb([spec.signed_bytes(), spec.signature], use_bin_type=True)


def _sign(identity: Identity, spec: RunSpec) -> bytes:
    import hashlib

    return identity.sign(b"atoll/spec/v1\0" + hashlib.sha256(spec.signed_bytes()).digest())


def _raises(call) -> str:
    with pytest.raises(SpecError) as info:
        call()
    return str(info.value)
