"""Run addresses: parsing, the addresses a spec gives, fetching with retries, and the CLI
(the fetch over real p2pd: tests/integration/test_join.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.cli import main
from node.cli.running import _with_spec_file
from node.config import load_config
from node.spec import SpecError, create_spec
from node.spec_file import parse_spec, read_spec, spec_text
from node.swarm import join
from node.swarm.join import RunAddress, fetch_spec, run_addresses, save_spec
from tests.unit.node.test_spec import _fake_daemon
from verification.identity import Identity

ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
MADDR = f"/ip4/203.0.113.7/tcp/31337/p2p/{ALICE.peer_id}"


def _spec(*overrides: str, bootstrap: tuple[str, ...] = (MADDR,), signer: Identity = ALICE):
    cfg = load_config(None, ["run.run_id='demo'", *overrides])
    return create_spec(cfg, signer, bootstrap=bootstrap, now=1_000.0)


def test_an_address_is_the_run_and_a_multiaddr_naming_the_operator() -> None:
    address = RunAddress.parse(f"demo@{MADDR}")
    assert (address.run_id, address.maddr, address.peer_id) == ("demo", MADDR, ALICE.peer_id)
    assert str(address) == f"demo@{MADDR}"
    # a run id may hold an @: the multiaddr never does
    assert RunAddress.parse(f"me@home@{MADDR}").run_id == "me@home"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (MADDR, "expected RUN_ID@/ip4/"),
        (f"@{MADDR}", "expected RUN_ID@/ip4/"),
        ("demo@/ip4/203.0.113.7/tcp/31337", "ending in /p2p/<PeerID>"),
        ("demo@ip4/203.0.113.7/tcp/1/p2p/" + ALICE.peer_id, "ending in /p2p/<PeerID>"),
        ("demo@/ip4/203.0.113.7/tcp/1/p2p/alice", "'alice' is not a PeerID"),
        (f"{'r' * 65}@{MADDR}", "at most 64 characters"),
    ],
)
def test_a_bad_address_is_one_line_saying_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(SpecError, match="run address") as raised:
        RunAddress.parse(text)
    assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_a_spec_gives_an_address_for_each_bootstrap_peer_its_creator_runs() -> None:
    other = f"/ip4/203.0.113.8/tcp/31337/p2p/{BOB.peer_id}"
    spec = _spec(bootstrap=(MADDR, other))
    assert [str(a) for a in run_addresses(spec)] == [f"demo@{MADDR}"]
    assert run_addresses(_spec(bootstrap=(other,))) == []


@pytest.mark.parametrize("trigger", ["sync.trigger='seconds'", "sync.trigger='steps'"])
def test_the_served_text_verifies_as_the_same_spec(trigger: str) -> None:
    spec = _spec(trigger)
    again = parse_spec(spec_text(spec).encode(), "served", operator=ALICE.peer_id)
    assert again == spec and again.digest == spec.digest
    with pytest.raises(SpecError, match=f"^served: signed by {ALICE.peer_id}, not by"):
        parse_spec(spec_text(spec).encode(), "served", operator=BOB.peer_id)
    with pytest.raises(SpecError, match="^served: not UTF-8"):
        parse_spec(b"\xff\xfe", "served")


def test_a_fetch_asks_again_while_the_peer_is_not_up_then_verifies(monkeypatch) -> None:
    spec = _spec()
    answers: list[object] = [join._NotYet("did not answer"), join._NotYet("no_handler")]
    answers.append(spec_text(spec).encode())
    asked: list[str] = []

    def ask(address: RunAddress, host: str, timeout: float) -> bytes:
        asked.append(host)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(join, "_ask", ask)
    monkeypatch.setattr(join.time, "sleep", lambda s: None)
    got, raw = fetch_spec(RunAddress.parse(f"demo@{MADDR}"), host="10.0.0.5", wait=60)
    assert got == spec and raw == spec_text(spec).encode() and asked == ["10.0.0.5"] * 3
    # not asked again without a wait; the reason is in the one line
    monkeypatch.setattr(join, "_ask", lambda *a: (_ for _ in ()).throw(join._NotYet("gone")))
    with pytest.raises(SpecError, match=f"^run address demo@{MADDR}: gone$"):
        fetch_spec(RunAddress.parse(f"demo@{MADDR}"))


def test_a_fetch_refuses_another_signer_and_another_run(monkeypatch) -> None:
    address = RunAddress.parse(f"demo@{MADDR}")
    forged = _spec(bootstrap=(), signer=BOB)  # a valid spec, by someone else
    monkeypatch.setattr(join, "_ask", lambda *a: spec_text(forged).encode())
    with pytest.raises(SpecError, match=f"signed by {BOB.peer_id}, not by the operator"):
        fetch_spec(address)
    assert fetch_spec(address, operator=BOB.peer_id)[0] == forged  # when pinned to it
    other = _spec("run.run_id='other'")
    monkeypatch.setattr(join, "_ask", lambda *a: spec_text(other).encode())
    with pytest.raises(SpecError, match="served run 'other', not 'demo'"):
        fetch_spec(address)


def test_a_fetched_spec_is_saved_as_served(tmp_path: Path) -> None:
    spec = _spec()
    raw = spec_text(spec).encode()
    path = tmp_path / "node" / "run-spec.toml"
    save_spec(raw, path)
    save_spec(raw, path)  # a later join replaces it
    assert path.read_bytes() == raw and read_spec(path) == spec
    (tmp_path / "a-file").write_text("")  # where a folder should be
    with pytest.raises(SpecError, match="cannot write"):
        save_spec(raw, tmp_path / "a-file" / "run-spec.toml")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["join", "A", "--rounds", "3"], ["run", "--spec", "F", "--operator", "P", "--rounds", "3"]),
        (["-v", "join", "--data-dir", "d", "A"], ["-v", "run", "--spec", "F", "--operator", "P",
                                                  "--data-dir", "d"]),
        (["run", "--join", "A", "--rounds", "3"], ["run", "--spec", "F", "--operator", "P",
                                                   "--rounds", "3"]),
        (["run", "--join=A"], ["run", "--spec", "F", "--operator", "P"]),
    ],
)  # fmt: skip
def test_a_site_that_joins_starts_its_ranks_from_the_fetched_file(
    argv: list[str], expected: list[str]
) -> None:
    assert _with_spec_file(argv, "A", "F", "P") == expected


def test_cli_join_runs_the_fetched_spec_and_keeps_a_copy(tmp_path: Path, monkeypatch, capsys):
    spec = _spec("sync.trigger='steps'")
    fetched: list[tuple] = []

    def fake_fetch(address, operator, *, host, timeout, wait):
        fetched.append((str(address), operator, host, timeout, wait))
        return spec, spec_text(spec).encode()

    monkeypatch.setattr(join, "fetch_spec", fake_fetch)
    calls = _fake_daemon(monkeypatch)
    data_dir = tmp_path / "node"
    args = ["join", f"demo@{MADDR}", "--data-dir", str(data_dir)]
    assert main([*args, "--set", "network.host='10.0.0.5'", "--set", "network.join_timeout=7"]) == 0
    assert fetched == [(f"demo@{MADDR}", ALICE.peer_id, "10.0.0.5", 30.0, 7.0)]
    assert read_spec(data_dir / "run-spec.toml", operator=ALICE.peer_id) == spec
    assert len(calls) == 1 and calls[0]["spec"] == spec
    assert calls[0]["cfg"].run.data_dir == str(data_dir)
    assert "a copy is in" in capsys.readouterr().out
    # run --join is the same; --operator pins another key
    assert main(["run", "--join", f"demo@{MADDR}", "--operator", BOB.peer_id,
                 "--data-dir", str(data_dir)]) == 0  # fmt: skip
    assert fetched[-1][1] == BOB.peer_id and len(calls) == 2


def test_cli_join_refuses_what_cannot_work_before_anything_starts(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    calls = _fake_daemon(monkeypatch)
    monkeypatch.setattr(join, "fetch_spec", lambda *a, **k: pytest.fail("fetched"))
    address = f"demo@{MADDR}"
    cases = [
        (["join", "demo"], "run address 'demo': expected RUN_ID@"),
        (["run", "--join", address, "--spec", "x.toml"], "give --join or --spec, not both"),
        (["join", address, "--set", "network.join_timeout=-1"], "network.join_timeout"),
    ]
    for argv, said in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("atoll: ") and said in err and "\n" not in err, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["join", address]) == 2
    assert "atoll spec fetch ADDRESS --out FILE" in capsys.readouterr().err
    assert calls == []
