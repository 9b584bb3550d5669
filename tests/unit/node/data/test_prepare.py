"""`atoll data prepare` on documents: formats, EOS, the split, bytes per token, uint32,
broken inputs, and an interrupted prepare that resumes to the same shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from node.data import prepare as prep
from node.data import prepare_tokens
from node.data.corpus import BatchStream, DataError, load_shards, read_meta, stdlib_files
from node.data.sources import is_val
from node.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from tests.waiting import wait_until

DOCS = [path.read_text(encoding="utf-8") for _, path in stdlib_files()[:30]]
DOCS += ["short note", "naïve café 🚀", DOCS[0]]  # a duplicate lands where its twin does


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok") / "tokenizer"
    save_tokenizer(train_tokenizer(DOCS, 500), folder)
    return folder


def _as_text(root: Path, docs: list[str]) -> list[str]:
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return [str(root / "*.txt")]


def _as_jsonl(root: Path, docs: list[str]) -> list[str]:
    root.mkdir()
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [str(root / "docs.jsonl")]


def _as_parquet(root: Path, docs: list[str]) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    half = len(docs) // 2  # two files, in path order
    pq.write_table(pa.table({"content": docs[:half]}), root / "a.parquet")
    pq.write_table(pa.table({"content": docs[half:]}), root / "b.parquet")
    return [str(root / "*.parquet")]


def _shards(out: Path) -> tuple[bytes, bytes, dict]:
    return (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes(), read_meta(out)


def test_text_jsonl_and_parquet_of_the_same_documents_give_the_same_tokens(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    made = {}
    for name, write, extra in [
        ("text", _as_text, {}),
        ("jsonl", _as_jsonl, {"field": "body"}),
        ("parquet", _as_parquet, {"column": "content"}),
    ]:
        patterns = write(tmp_path / f"in-{name}", DOCS)
        prep.prepare(
            patterns, tmp_path / name, tokenizer=str(tokenizer_dir), piece_mb=0.05, **extra
        )
        train, val, meta = _shards(tmp_path / name)
        made[name] = (train, val, {k: v for k, v in meta.items() if k != "files"})
    assert made["text"] == made["jsonl"] == made["parquet"]
    train, val, meta = _shards(tmp_path / "text")
    tok = load_tokenizer(tokenizer_dir)
    assert meta["tokenizer"]["digest"] == tok.digest and meta["dtype"] == "uint16"
    assert meta["split"] == "document" and meta["files"] == len(DOCS)
    # every document ends with EOS; cut there, the pieces are the documents of each split
    held_out = [d for d in DOCS if is_val(d, 0.1)]
    kept = [d for d in DOCS if not is_val(d, 0.1)]
    assert held_out and kept and DOCS[0] in kept  # both copies of DOCS[0] on one side
    for blob, docs in ((train, kept), (val, held_out)):
        ids = np.frombuffer(blob, dtype="<u2").tolist()
        assert ids[-1] == tok.eos_id
        cut = [i for i, t in enumerate(ids) if t == tok.eos_id]
        pieces = [ids[a + 1 : b] for a, b in zip([-1, *cut[:-1]], cut)]
        assert [tok.decode(p) for p in pieces] == docs
    assert meta["val_bytes"] == sum(len(d.encode()) for d in held_out)
    assert meta["bytes_per_token"] == pytest.approx(meta["val_bytes"] / meta["val_tokens"])
    corpus = load_shards(tmp_path / "text", 16, 500)
    assert corpus.bytes_per_token == meta["bytes_per_token"] > 2.0
    assert Path(corpus.tokenizer["folder"]) == tmp_path / "text" / "tokenizer"


def test_a_tokenizer_trained_by_prepare_is_saved_with_the_shards(tmp_path: Path) -> None:
    patterns = _as_text(tmp_path / "in", DOCS)
    meta = prep.prepare(patterns, tmp_path / "out", train_vocab=400, workers=2, piece_mb=0.1)
    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    assert meta["vocab_size"] == 400 and meta["tokenizer"]["digest"] == tok.digest
    assert tok.decode(tok.encode(DOCS[1])) == DOCS[1]
    assert not (tmp_path / "out" / ".prepare").exists()  # the work folder is cleared


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    words["</s>"] = 70_000
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "big.json"))
    docs = [" ".join(f"w{(i * 7919 + j * 104729) % 70_000}" for j in range(300)) for i in range(40)]
    patterns = _as_text(tmp_path / "in", docs)
    meta = prep.prepare(patterns, tmp_path / "out", tokenizer=str(tmp_path / "big.json"))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001
    corpus = load_shards(tmp_path / "out", 32, 70_001)
    inputs, targets = BatchStream(corpus.train, 4, 32, "k").next()
    assert int(inputs.max()) > 65_535 and inputs.dtype.is_floating_point is False
    with pytest.raises(DataError, match="set model.vocab_size = 70001"):
        load_shards(tmp_path / "out", 32, 65_536)


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "only empty documents"),
        ("no_rows", "hold no documents"),
        ("wrong_field", "no 'text' field (it has 'body'); name it with --field"),
        ("wrong_column", "no 'text' column (it has 'content'); name it with --column"),
        ("binary", "a binary file, not text"),
        ("latin1", "not UTF-8 text"),
        ("bad_jsonl", "cannot be read as JSON lines"),
        ("not_parquet", "cannot be read as a parquet file"),
        ("both", "--tokenizer and --train-tokenizer: use one or the other"),
        ("missing", "matches no readable file"),
    ],
)
def test_broken_inputs_are_one_line_errors(
    tmp_path: Path, tokenizer_dir: Path, case: str, message: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    options = {"tokenizer": str(tokenizer_dir)}
    path = src / {"wrong_column": "x.parquet", "not_parquet": "x.parquet"}.get(
        case, "x.jsonl" if case in ("no_rows", "wrong_field", "bad_jsonl") else "x.txt"
    )
    if case in ("empty", "no_rows"):
        path.write_text("")
    elif case == "wrong_field":
        path.write_text('{"body": "a"}\n')
    elif case == "wrong_column":
        _as_parquet(src / "p", ["a", "b"])
        path = src / "p" / "a.parquet"
    elif case == "binary":
        path.write_bytes(b"text\0\x01\x02 and more")
    elif case == "latin1":
        path.write_bytes("café".encode("latin-1"))
    elif case == "bad_jsonl":
        path.write_text('{"text": "fine"}\n{"text": broken\n')
    elif case == "not_parquet":
        path.write_bytes(b"PAR1 not really")
    elif case == "both":
        path.write_text("a document")
        options["train_vocab"] = 300
    elif case == "missing":
        path = src / "nothing-here.txt"
    with pytest.raises(DataError) as info:
        prep.prepare([str(path)], tmp_path / "out", **options)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_existing_shards_are_kept_unless_forced(tmp_path: Path, tokenizer_dir: Path) -> None:
    patterns = _as_text(tmp_path / "in", DOCS[:5])
    prep.prepare(patterns, tmp_path / "out", tokenizer=str(tokenizer_dir))
    with pytest.raises(DataError, match="already holds shards"):
        prep.prepare(patterns, tmp_path / "out", tokenizer=str(tokenizer_dir))
    meta = prep.prepare(patterns, tmp_path / "out", force=True)  # now as bytes
    assert meta["dtype"] == "uint8" and not (tmp_path / "out" / "tokenizer").exists()


def _count_pieces(monkeypatch) -> list[int]:
    """The index of every piece tokenized from now on, in order."""
    calls: list[int] = []
    real = prep._tokenize_piece

    def counted(index: int, texts: list[str]) -> dict:
        calls.append(index)
        return real(index, texts)

    monkeypatch.setattr(prep, "_tokenize_piece", counted)
    return calls


def test_an_interrupted_prepare_resumes_without_redoing_finished_pieces(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch
) -> None:
    patterns = _as_text(tmp_path / "in", DOCS)
    options = {"tokenizer": str(tokenizer_dir), "piece_mb": 0.02}
    prep.prepare(patterns, tmp_path / "whole", **options)
    calls = _count_pieces(monkeypatch)

    def stop_after_five(done: int, total: int) -> None:
        if len(calls) == 5:
            raise KeyboardInterrupt  # Ctrl-C between two pieces

    with pytest.raises(prep.Interrupted, match="run the same command again to resume"):
        prep.prepare(patterns, tmp_path / "out", progress=stop_after_five, **options)
    assert len(list((tmp_path / "out" / ".prepare").glob("piece-*.json"))) == 5
    # another job in the same folder is refused, saying how to go on
    with pytest.raises(DataError, match="holds an unfinished prepare of other settings"):
        prep.prepare(patterns, tmp_path / "out", tokenizer=str(tokenizer_dir), piece_mb=0.5)
    calls.clear()
    prep.prepare(patterns, tmp_path / "out", **options)
    total = len(list(prep._pieces(prep._Documents([("x", _rows(DOCS), "text")]), 20971)))
    assert total > 10 and sorted(calls) == list(range(5, total))
    assert _shards(tmp_path / "out") == _shards(tmp_path / "whole")
    # --force starts another job over whatever the folder holds
    calls.clear()
    with pytest.raises(prep.Interrupted):
        prep.prepare(patterns, tmp_path / "again", progress=stop_after_five, **options)
    meta = prep.prepare(patterns, tmp_path / "again", tokenizer=str(tokenizer_dir), force=True)
    assert meta["train_tokens"] == _shards(tmp_path / "whole")[2]["train_tokens"]


def _rows(docs: list[str]):
    import datasets

    return datasets.Dataset.from_dict({"text": docs})


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_workers_and_the_same_command_finishes_the_job(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    src = tmp_path / "in"
    src.mkdir()
    # about 6 MB in 1,500 pieces: several seconds of work for two workers, so the job is
    # still running when the interrupt arrives on a loaded machine
    for i in range(36):
        (src / f"d{i:02d}.txt").write_text("\n\n".join(DOCS[(i + j) % 30] for j in range(6)))
    command = [
        sys.executable,
        "-m",
        "node.cli",
        "data",
        "prepare",
        str(src / "*.txt"),
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        str(tokenizer_dir),
        "--workers",
        "2",
        "--piece-mb",
        "0.004",
    ]
    # SIGINT as a terminal would deliver it: a suite started as a background job (`make
    # test &`) passes SIGINT on ignored, and the job would then finish regardless
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    work = tmp_path / "out" / ".prepare"
    try:
        wait_until(lambda: any(work.glob("piece-*.json")), 60, interval=0.01)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"workers left running: {alive}"
    assert not (tmp_path / "out" / "meta.json").exists()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh = subprocess.run(
        [*command[:7], str(tmp_path / "fresh"), *command[8:]], capture_output=True, timeout=120
    )
    assert fresh.returncode == 0
    assert _shards(tmp_path / "out") == _shards(tmp_path / "fresh")


# ---- user reports: line numbers, a fixed input, binary files, datasets' logs, memory ----


def _jsonl(path: Path, broken: bool = True) -> Path:
    """60 documents, one a line; ``broken``: line 50 is not JSON."""
    lines = [json.dumps({"text": DOCS[i % len(DOCS)]}) for i in range(60)]
    if broken:
        lines[49] = '{"text": broken'
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_broken_json_line_is_one_line_of_atoll_naming_the_file_and_line(
    tmp_path: Path,
) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl")
    command = [sys.executable, "-m", "node.cli", "data", "prepare", str(bad)]
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    # not datasets' own two lines about it (its handler's and the root logger's)
    assert done.stderr.splitlines() == [
        f"atoll: {bad}: line 50: cannot be read as JSON lines (Expecting value at column 10)"
    ]


def test_a_field_that_is_not_text_is_named_by_its_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": null}\n')
    with pytest.raises(DataError, match=r"x.jsonl: line 4: 'text' is NoneType, not text"):
        prep.prepare([str(path)], tmp_path / "out")


def test_a_prepare_that_failed_on_an_input_runs_again_once_it_is_fixed(
    tmp_path: Path, tokenizer_dir: Path, caplog
) -> None:
    bad = _jsonl(tmp_path / "in" / "docs.jsonl")
    options = {"tokenizer": str(tokenizer_dir), "piece_mb": 0.02}
    with pytest.raises(DataError, match="line 50"):
        prep.prepare([str(bad)], tmp_path / "out", **options)
    _jsonl(bad, broken=False)  # the user fixes line 50 and runs the same command
    with caplog.at_level("INFO", logger="node.data.prepare"):
        meta = prep.prepare([str(bad)], tmp_path / "out", **options)  # no --force
    said = [r.getMessage() for r in caplog.records if r.name == "node.data.prepare"]
    assert len(said) == 1 and "inputs changed" in said[0] and str(bad) in said[0], said
    prep.prepare([str(bad)], tmp_path / "fresh", **options)
    assert _shards(tmp_path / "out") == _shards(tmp_path / "fresh")
    assert meta["documents"]["train_docs"] + meta["documents"]["val_docs"] == 60


def test_changed_inputs_start_over_keeping_the_pieces_that_did_not_change(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch
) -> None:
    patterns = _as_text(tmp_path / "in", DOCS)
    options = {"tokenizer": str(tokenizer_dir), "piece_mb": 0.02}
    calls = _count_pieces(monkeypatch)

    def stop_after_five(done: int, total: int) -> None:
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(prep.Interrupted):
        prep.prepare(patterns, tmp_path / "out", progress=stop_after_five, **options)
    # the first document changes but keeps its length, and a new last one comes: the
    # first piece is checked against its documents and done again, pieces 1 to 4 kept
    first = tmp_path / "in" / "doc000.txt"
    assert "import" in DOCS[0]
    first.write_text(DOCS[0].replace("import", "IMPORT", 1), encoding="utf-8")
    os.utime(first, ns=(first.stat().st_mtime_ns + 10**9,) * 2)
    (tmp_path / "in" / "doc999.txt").write_text("a new last document", encoding="utf-8")
    calls.clear()
    prep.prepare(patterns, tmp_path / "out", **options)
    assert calls[0] == 0 and sorted(calls[1:]) == list(range(5, max(calls) + 1)), calls
    calls.clear()
    prep.prepare(patterns, tmp_path / "fresh", **options)
    assert _shards(tmp_path / "out") == _shards(tmp_path / "fresh")


def test_changed_inputs_of_a_trained_tokenizer_train_it_again(tmp_path: Path) -> None:
    patterns = _as_text(tmp_path / "in", DOCS[:12])
    options = {"train_vocab": 300, "piece_mb": 0.02}

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(prep.Interrupted):
        prep.prepare(patterns, tmp_path / "out", progress=stop, **options)
    (tmp_path / "in" / "doc000.txt").write_text(DOCS[20], encoding="utf-8")
    meta = prep.prepare(patterns, tmp_path / "out", **options)
    fresh = prep.prepare(patterns, tmp_path / "fresh", **options)
    assert meta["tokenizer"]["digest"] == fresh["tokenizer"]["digest"]
    assert _shards(tmp_path / "out") == _shards(tmp_path / "fresh")


@pytest.mark.parametrize("beside", [None, "other.txt", "other.jsonl"])
def test_a_binary_file_is_refused_alone_or_among_others(tmp_path: Path, beside: str | None) -> None:
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\0" * 4096)
    paths = [str(nul)]
    if beside:
        other = tmp_path / beside
        other.write_text(json.dumps({"text": "fine"}) if beside.endswith("jsonl") else "fine")
        paths.append(str(other))
    with pytest.raises(DataError) as info:
        prep.prepare(paths, tmp_path / "out")  # bytes, or documents beside a .jsonl
    assert str(info.value) == f"{nul}: a binary file, not text (it holds NUL bytes)"


def _one_line(words: list[str], size: int) -> str:
    out, n, i = [], 0, 0
    while n < size:
        out.append(words[i % len(words)])
        n, i = n + len(out[-1]) + 1, i + 7
    return " ".join(out)


def test_a_document_longer_than_a_piece_gets_the_tokens_of_the_whole(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    doc = _one_line(" ".join(DOCS).split(), 300_000)
    patterns = _as_text(tmp_path / "in", [doc])
    prep.prepare(patterns, tmp_path / "out", tokenizer=str(tokenizer_dir), piece_mb=0.05)
    tok = load_tokenizer(tokenizer_dir)
    train, val, _ = _shards(tmp_path / "out")
    ids = np.frombuffer(train + val, dtype="<u2").tolist()
    assert ids == [*tok.encode(doc), tok.eos_id]
    cut = list(prepare_tokens.cut(doc, 40_000))  # parts of the piece, cut between words
    assert "".join(cut) == doc and len(cut) > 7 and max(map(len, cut)) <= 40_000
    assert all(p[-1] != " " and q[0] == " " and q[1] != " " for p, q in zip(cut, cut[1:]))


_PEAK = """
import resource, sys
from pathlib import Path
import datasets, numpy, psutil, tokenizers  # their memory is not the document's
from node.data import prepare
doc, out, tokenizer = sys.argv[1:]
before = psutil.Process().memory_info().rss
prepare.prepare([doc], Path(out), tokenizer=tokenizer, piece_mb=1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, before)
"""


def test_memory_follows_the_piece_not_the_longest_document(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    # one line of 8 MiB: tokenized whole it took ~185 bytes of memory per byte of text
    doc = tmp_path / "one-line.txt"
    doc.write_text(_one_line(" ".join(DOCS).split(), 8 * 2**20), encoding="utf-8")
    command = [sys.executable, "-c", _PEAK, str(doc), str(tmp_path / "out"), str(tokenizer_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    peak, before = map(int, done.stdout.split())
    per_byte = peak / doc.stat().st_size
    said = f"{per_byte:.0f} bytes of memory per byte of the document ({before} before)"
    # about 27 alone on the machine; up to 103 within the whole unit suite at -n 2 (the
    # same environment and inputs: the cause was not found), against 185-219 for
    # the whole document given to the tokenizer at once
    assert per_byte < 140, said
