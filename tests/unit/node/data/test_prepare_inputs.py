"""The inputs of ``atoll data prepare``: each file's kind by its name, its documents, and
a broken input named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.data.prepare_inputs import file_kind, read_parts
from node.data.sources import DataError


def test_a_files_kind_is_read_from_its_name() -> None:
    assert [file_kind(Path(n)) for n in ("a.jsonl", "b.JSONL.gz", "c.ndjson", "d.json")] == [
        "json"
    ] * 4
    assert file_kind(Path("e.parquet")) == "parquet"
    assert file_kind(Path("f.txt")) == file_kind(Path("g.py")) == "text"


def _files(*paths: Path) -> list[tuple[str, Path]]:
    return [(p.as_posix(), p) for p in paths]


def test_text_runs_are_read_together_and_json_lines_by_their_field(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.txt").write_text("second document\n")
    lines = tmp_path / "c.jsonl"
    lines.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate("xyz")))
    (tmp_path / "d.jsonl").write_text("")  # empty: no documents, no error
    files = _files(tmp_path / "a.txt", tmp_path / "b.txt", lines, tmp_path / "d.jsonl")
    parts = read_parts(files, "body", "text", tmp_path / "cache")
    assert [(name, column) for name, _, column in parts] == [
        ("2 text files", "text"),
        (str(lines), "body"),
    ]
    assert parts[1][1]["body"] == ["x", "y", "z"]
    assert sorted(parts[0][1]["text"]) == ["first document\n", "second document\n"]


def test_a_missing_field_names_the_file_the_fields_and_the_option(tmp_path: Path) -> None:
    lines = tmp_path / "c.jsonl"
    lines.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl: no 'text' field \(it has 'content'\).*--field"):
        read_parts(_files(lines), "text", "text", tmp_path / "cache")


def test_binary_and_undecodable_text_inputs_are_refused_before_reading(tmp_path: Path) -> None:
    binary, latin = tmp_path / "a.bin", tmp_path / "b.txt"
    binary.write_bytes(b"text\0more")
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="a binary file, not text"):
        read_parts(_files(binary), "text", "text", tmp_path / "cache")
    with pytest.raises(DataError, match="not UTF-8 text"):
        read_parts(_files(latin), "text", "text", tmp_path / "cache")


def test_a_malformed_json_line_is_named_by_its_line_as_an_editor_numbers_it(
    tmp_path: Path,
) -> None:
    lines = [json.dumps({"text": f"document {i}"}) for i in range(100)]
    lines[9] = ""  # a blank line counts as a line, as in an editor
    lines[49] = '{"text": broken'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        read_parts(_files(bad), "text", "text", tmp_path / "cache")
    assert str(info.value) == (
        f"{bad}: line 50: cannot be read as JSON lines (Expecting value at column 10)"
    )
    lines[49] = '["a list"]'
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: line 50: .*\(an array, not an object\)"):
        read_parts(_files(bad), "text", "text", tmp_path / "cache2")
