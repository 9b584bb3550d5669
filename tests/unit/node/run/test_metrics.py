import json
import logging
import math
import os
import threading
import time

import pytest

from node.run import metrics
from node.run.metrics import EventLog, StatusWriter, read_events, read_status


def test_status_first_update_writes_and_merges(tmp_path):
    path = tmp_path / "status.json"
    writer = StatusWriter(path, min_interval=60)
    before = time.time()
    writer.update(round=1, loss=3.5, peers=["a", "b"])
    on_disk = read_status(path)
    assert on_disk == writer.current
    assert on_disk["round"] == 1 and on_disk["loss"] == 3.5 and on_disk["peers"] == ["a", "b"]
    assert before <= on_disk["updated"] <= time.time()


def test_status_throttles_until_forced(tmp_path):
    path = tmp_path / "status.json"
    writer = StatusWriter(path, min_interval=60)
    writer.update(step=1)
    writer.update(step=2, loss=1.0)
    writer.update(step=3)
    # Throttled: the file still holds the first snapshot, the writer holds the merge.
    assert read_status(path)["step"] == 1
    assert writer.current["step"] == 3 and writer.current["loss"] == 1.0
    writer.update(force=True)
    on_disk = read_status(path)
    assert on_disk["step"] == 3 and on_disk["loss"] == 1.0


def test_status_writes_again_after_interval(tmp_path):
    path = tmp_path / "status.json"
    writer = StatusWriter(path, min_interval=0.05)
    writer.update(step=1)
    writer.update(step=2)
    assert read_status(path)["step"] == 1
    time.sleep(0.08)
    writer.update(step=3)
    assert read_status(path)["step"] == 3


def test_status_replaces_atomically(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    calls = []
    real_replace = os.replace

    def spy(src, dst):
        calls.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(metrics.os, "replace", spy)
    writer = StatusWriter(path, min_interval=0)
    writer.update(a=1)
    writer.update(a=2)
    assert len(calls) == 2
    for src, dst in calls:
        assert dst == os.fspath(path)
        assert os.path.dirname(src) == os.fspath(tmp_path)
    # Only the final file is left: temp files were all renamed into place.
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_status_reader_never_sees_a_torn_file(tmp_path):
    path = tmp_path / "status.json"
    writer = StatusWriter(path, min_interval=0)
    writer.update(step=0, blob="x" * 200_000)
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            status = read_status(path)
            if status is None or len(status["blob"]) != 200_000:
                bad.append(status)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in range(1, 100):
            writer.update(step=step, blob=str(step % 10) * 200_000)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert bad == []
    assert read_status(path)["step"] == 99


def test_status_failed_write_leaves_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    writer = StatusWriter(path, min_interval=0)
    writer.update(step=1)

    def crash(src, dst):
        raise OSError("simulated")

    monkeypatch.setattr(metrics.os, "replace", crash)
    with pytest.raises(OSError):
        writer.update(step=2)
    monkeypatch.undo()
    assert read_status(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_status_rejects_unserialisable_value(tmp_path):
    writer = StatusWriter(tmp_path / "status.json", min_interval=0)
    writer.update(step=1)
    with pytest.raises(TypeError):
        writer.update(step=2, obj=object())
    assert writer.current["step"] == 1 and "obj" not in writer.current
    assert read_status(tmp_path / "status.json")["step"] == 1


def test_status_nan_loss_round_trips(tmp_path):
    writer = StatusWriter(tmp_path / "status.json")
    writer.update(loss=float("nan"))
    assert math.isnan(read_status(tmp_path / "status.json")["loss"])


def test_status_current_is_a_copy(tmp_path):
    writer = StatusWriter(tmp_path / "status.json")
    writer.update(step=1)
    writer.current["step"] = 99
    assert writer.current["step"] == 1


def test_status_negative_interval_refused(tmp_path):
    with pytest.raises(ValueError):
        StatusWriter(tmp_path / "status.json", min_interval=-1)


@pytest.mark.parametrize(
    "content",
    [b"", b'{"step": 3, "lo', b"not json", b"\xff\xfe\x00garbage", b"[1, 2]", b"null"],
)
def test_read_status_garbage_is_none(tmp_path, content):
    path = tmp_path / "status.json"
    path.write_bytes(content)
    assert read_status(path) is None


def test_read_status_missing_is_none(tmp_path):
    assert read_status(tmp_path / "status.json") is None
    assert read_status(tmp_path / "nowhere" / "status.json") is None


def test_event_log_round_trip(tmp_path):
    path = tmp_path / "events.jsonl"
    before = time.time()
    with EventLog(path) as log:
        log.write("start", peer="abc")
        log.write("round_done", round=1, loss=2.0)
        log.write("round_done", round=2, loss=1.5, peers=["x"])
    events = read_events(path)
    assert [e["event"] for e in events] == ["start", "round_done", "round_done"]
    assert events[0]["peer"] == "abc"
    assert events[2] == {
        "t": events[2]["t"],
        "event": "round_done",
        "round": 2,
        "loss": 1.5,
        "peers": ["x"],
    }
    times = [e["t"] for e in events]
    assert before <= times[0] <= times[1] <= times[2] <= time.time()
    assert [e["round"] for e in read_events(path, "round_done")] == [1, 2]
    assert read_events(path, "nothing") == []
    # One event per line, each a JSON object.
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(isinstance(json.loads(line), dict) for line in lines)


def test_event_visible_before_close(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    try:
        log.write("tick", n=1)
        assert read_events(path) == [{"t": read_events(path)[0]["t"], "event": "tick", "n": 1}]
        assert path.read_bytes().endswith(b"\n")
    finally:
        log.close()


def test_event_log_appends_across_reopen(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.write("a")
    with EventLog(path) as log:
        log.write("b")
    assert [e["event"] for e in read_events(path)] == ["a", "b"]


def test_torn_last_line_is_skipped(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.write("a", i=1)
        log.write("b", i=2)
    with open(path, "ab") as f:
        f.write(b'{"t": 1.0, "event": "c", "i"')
    with caplog.at_level(logging.WARNING, logger="node.run.metrics"):
        events = read_events(path)
    assert [e["event"] for e in events] == ["a", "b"]
    assert caplog.records == []


def test_reopen_after_torn_line_starts_a_fresh_line(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.write("a")
    with open(path, "ab") as f:
        f.write(b'{"t": 1.0, "ev')
    with EventLog(path) as log:
        log.write("b")
    with caplog.at_level(logging.WARNING, logger="node.run.metrics"):
        events = read_events(path)
    assert [e["event"] for e in events] == ["a", "b"]
    # The torn fragment is now a damaged middle line: skipped, and said so.
    assert any("line 2" in r.getMessage() for r in caplog.records)


def test_read_events_missing_file(tmp_path):
    assert read_events(tmp_path / "events.jsonl") == []


def test_event_log_concurrent_writers_keep_lines_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:

        def worker(w: int) -> None:
            for i in range(200):
                log.write("step", worker=w, i=i, pad="y" * 500)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    events = read_events(path)
    assert len(events) == 800
    for w in range(4):
        assert [e["i"] for e in events if e["worker"] == w] == list(range(200))


def test_event_log_misuse(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        log.write("x", t=5)
    with pytest.raises(TypeError):
        log.write("x", obj=object())
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.write("x")
    assert read_events(tmp_path / "events.jsonl") == []
