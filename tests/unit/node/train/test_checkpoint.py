import hashlib
import logging
import os

import pytest
import torch
from torch import nn

from node.train import checkpoint
from node.train.checkpoint import (
    HEADER_SIZE,
    MAGIC,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)


def _trained_state(seed: int = 0) -> dict:
    """A model plus AdamW and SGD-momentum optimizers after two steps each."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for opt in (adamw, sgd, adamw, sgd):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
    return {
        "model": model.state_dict(),
        "inner": adamw.state_dict(),
        "outer": sgd.state_dict(),
        "round": 7,
        "tokens": 12_345,
        "loss": 2.5,
        "run_id": "demo",
        "history": [1.0, 0.5, None],
        "shape": (torch.Size([2, 3]), torch.bfloat16, torch.device("cpu")),
        "nested": {"a": {"b": [1, 2, 3]}},
    }


def _flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_round_trip_model_and_optimizer_states(tmp_path):
    state = _trained_state()
    info = save_checkpoint(tmp_path, 7, state)
    assert info.path == tmp_path / "ckpt-00000007.pt"
    assert info.round == 7
    raw = info.path.read_bytes()
    assert raw[: len(MAGIC)] == MAGIC
    assert info.digest == hashlib.sha256(raw[HEADER_SIZE:]).hexdigest()
    assert raw[len(MAGIC) : HEADER_SIZE].hex() == info.digest

    loaded = load_checkpoint(info.path)
    torch.testing.assert_close(loaded["model"], state["model"])
    torch.testing.assert_close(loaded["inner"]["state"], state["inner"]["state"])
    torch.testing.assert_close(loaded["outer"]["state"], state["outer"]["state"])
    assert loaded["inner"]["param_groups"] == state["inner"]["param_groups"]
    assert loaded["outer"]["param_groups"] == state["outer"]["param_groups"]
    for key in ("round", "tokens", "loss", "run_id", "history", "shape", "nested"):
        assert loaded[key] == state[key]


def test_loaded_optimizer_state_resumes_identically(tmp_path):
    """A model and AdamW restored from a checkpoint take the same next step."""
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 3)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    save_checkpoint(tmp_path, 3, {"model": model.state_dict(), "opt": opt.state_dict()})

    restored = nn.Linear(3, 2)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    state = load_checkpoint(tmp_path / "ckpt-00000003.pt")
    restored.load_state_dict(state["model"])
    restored_opt.load_state_dict(state["opt"])
    for m, o in ((model, opt), (restored, restored_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    torch.testing.assert_close(restored.state_dict(), model.state_dict())


def test_single_flipped_payload_byte_is_caught(tmp_path):
    info = save_checkpoint(tmp_path, 1, _trained_state())
    size = info.path.stat().st_size
    _flip_byte(info.path, HEADER_SIZE + (size - HEADER_SIZE) // 2)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        load_checkpoint(info.path)


def test_flipped_digest_byte_is_caught(tmp_path):
    info = save_checkpoint(tmp_path, 1, {"x": torch.ones(3)})
    _flip_byte(info.path, len(MAGIC) + 5)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        load_checkpoint(info.path)


@pytest.mark.parametrize("cut", [-1, -200, HEADER_SIZE, 10, 0])
def test_truncation_is_caught(tmp_path, cut):
    info = save_checkpoint(tmp_path, 1, _trained_state())
    data = info.path.read_bytes()
    info.path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError):
        load_checkpoint(info.path)


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "ckpt-00000001.pt"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="bad magic"):
        load_checkpoint(path)


def test_load_latest_falls_back_past_a_corrupt_newest(tmp_path, caplog):
    for r in (1, 2, 3):
        save_checkpoint(tmp_path, r, {"round": r, "w": torch.full((64,), float(r))})
    newest = tmp_path / "ckpt-00000003.pt"
    _flip_byte(newest, newest.stat().st_size - 30)

    with caplog.at_level(logging.WARNING, logger="node.train.checkpoint"):
        found = load_latest(tmp_path)
    assert found is not None
    info, state = found
    assert info.round == 2
    assert state["round"] == 2
    torch.testing.assert_close(state["w"], torch.full((64,), 2.0))
    assert any("round 3" in r.getMessage() for r in caplog.records)


def test_load_latest_falls_back_past_a_truncated_newest(tmp_path):
    for r in (4, 5):
        save_checkpoint(tmp_path, r, {"round": r})
    newest = tmp_path / "ckpt-00000005.pt"
    newest.write_bytes(newest.read_bytes()[: HEADER_SIZE + 7])
    info, state = load_latest(tmp_path)
    assert (info.round, state["round"]) == (4, 4)

    # Cut inside the header: list_checkpoints skips it, load_latest still falls back.
    newest.write_bytes(newest.read_bytes()[:12])
    info, state = load_latest(tmp_path)
    assert (info.round, state["round"]) == (4, 4)


def test_load_latest_none_when_nothing_valid(tmp_path):
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "missing") is None
    info = save_checkpoint(tmp_path, 1, {"round": 1})
    _flip_byte(info.path, HEADER_SIZE + 3)
    assert load_latest(tmp_path) is None


def test_keep_prunes_oldest(tmp_path):
    for r in range(1, 7):
        save_checkpoint(tmp_path, r, {"round": r}, keep=3)
    assert [i.round for i in list_checkpoints(tmp_path)] == [6, 5, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000004.pt",
        "ckpt-00000005.pt",
        "ckpt-00000006.pt",
    ]
    save_checkpoint(tmp_path, 7, {"round": 7}, keep=1)
    assert [i.round for i in list_checkpoints(tmp_path)] == [7]


def test_keep_never_removes_the_file_just_written(tmp_path):
    for r in (10, 11, 12):
        save_checkpoint(tmp_path, r, {"round": r}, keep=3)
    info = save_checkpoint(tmp_path, 5, {"round": 5}, keep=3)
    assert info.path.exists()
    assert load_checkpoint(info.path)["round"] == 5


def test_list_is_newest_first_and_ignores_temp_and_foreign_files(tmp_path):
    infos = {
        r: save_checkpoint(tmp_path, r, {"round": r}, keep=10) for r in (3, 1, 12, 100_000_000)
    }
    (tmp_path / ".ckpt-00000013-abc.tmp").write_bytes(MAGIC + bytes(40))
    (tmp_path / "ckpt-00000014.pt.tmp").write_bytes(b"junk")
    (tmp_path / "notes.txt").write_text("hello")
    listed = list_checkpoints(tmp_path)
    assert [i.round for i in listed] == [100_000_000, 12, 3, 1]
    assert listed == [infos[r] for r in (100_000_000, 12, 3, 1)]
    assert load_latest(tmp_path)[0].round == 100_000_000
    assert list_checkpoints(tmp_path / "missing") == []


def test_save_removes_leftover_temp_files(tmp_path):
    stale = tmp_path / ".ckpt-00000002-xyz.tmp"
    stale.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, 3, {"round": 3})
    assert not stale.exists()


def test_failed_replace_leaves_no_partial_file(tmp_path, monkeypatch):
    before = save_checkpoint(tmp_path, 1, {"w": torch.arange(10.0)})
    before_bytes = before.path.read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, 2, {"w": torch.arange(20.0)})
    monkeypatch.undo()

    assert not (tmp_path / "ckpt-00000002.pt").exists()
    assert list(tmp_path.glob("*.tmp")) == []
    assert before.path.read_bytes() == before_bytes
    info, state = load_latest(tmp_path)
    assert info == before
    torch.testing.assert_close(state["w"], torch.arange(10.0))


def test_failed_serialisation_leaves_no_partial_file(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"round": 1})

    def half_write(obj, f):
        f.write(b"PK\x03\x04 half of a zip")
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", half_write)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"round": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]


def test_resave_same_round_replaces(tmp_path):
    save_checkpoint(tmp_path, 4, {"v": 1})
    info = save_checkpoint(tmp_path, 4, {"v": 2})
    assert load_checkpoint(info.path) == {"v": 2}
    assert len(list_checkpoints(tmp_path)) == 1


class _Custom:
    pass


@pytest.mark.parametrize(
    "state",
    [{"obj": _Custom()}, {"nested": {"x": [1, {2, 3}]}}, {"f": frozenset()}],
)
def test_unloadable_state_is_refused_at_save(tmp_path, state):
    with pytest.raises(ValueError, match="weights_only"):
        save_checkpoint(tmp_path, 1, state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("round_", "keep"), [(-1, 3), (True, 3), (1.0, 3), (1, 0)])
def test_bad_arguments(tmp_path, round_, keep):
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, round_, {}, keep=keep)


def test_creates_missing_directory(tmp_path):
    info = save_checkpoint(tmp_path / "a" / "b", 0, {"ok": True})
    assert load_checkpoint(info.path) == {"ok": True}


def test_non_dict_payload_is_rejected(tmp_path):
    import io

    buf = io.BytesIO()
    torch.save([1, 2, 3], buf)
    payload = buf.getvalue()
    path = tmp_path / "ckpt-00000001.pt"
    path.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
    with pytest.raises(CheckpointError, match="not a dict"):
        load_checkpoint(path)


def test_temp_file_lives_in_target_directory(tmp_path, monkeypatch):
    """os.replace is only atomic within one filesystem, so the temp file must be a sibling."""
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((os.path.dirname(src), os.path.dirname(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    save_checkpoint(tmp_path, 1, {"round": 1})
    assert seen == [(str(tmp_path), str(tmp_path))]
