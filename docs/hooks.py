"""MkDocs hooks: the reference sections generated from the code and the results.

A page asks for a generated section with a marker on a line of its own:

- ``<!-- config-reference -->``: every section and key of the node config, with its
  type, default and description, read from :class:`node.config.AtollConfig` (its
  section dataclasses are found through its field types, the descriptions are the
  string literals right after each field, or a class docstring's ``Attributes:``);
- ``<!-- benchmark-tables -->``: one row per headline of ``benchmarks/results/*.json``
  with the command that reproduces it and the date it was measured;
- ``<!-- benchmark-table scale-load -->`` and ``<!-- benchmark-table scale-simulated -->``:
  the scale benchmark's detail tables; ``<!-- benchmark-table churn -->``,
  ``<!-- benchmark-table goodput -->``, ``<!-- benchmark-table islands -->``,
  ``<!-- benchmark-table sparse -->`` and
  ``<!-- benchmark-table checks -->`` (the robustness benchmark's checks mode) those
  benchmarks' own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the docs build may run without the project installed
    sys.path.insert(0, str(ROOT))

from benchmarks import churn, goodput, islands, sparse, tables  # noqa: E402
from benchmarks._robustness_checks_report import table as checks_table  # noqa: E402

__all__ = ["config_reference", "on_page_markdown"]

_MARKER = re.compile(r"^<!-- (config-reference|benchmark-tables|benchmark-table [\w-]+) -->$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replaces each marker line of a page with the section it names."""
    return _MARKER.sub(lambda m: _generate(m.group(1)), markdown)


def _generate(name: str) -> str:
    if name == "config-reference":
        return config_reference()
    if name == "benchmark-tables":
        return _benchmark_summary()
    detail = name.removeprefix("benchmark-table ")
    if detail == "checks":
        checks = json.loads((tables.RESULTS / "robustness-checks.json").read_text())
        return checks_table(checks)
    if detail in ("churn", "goodput", "islands", "sparse"):
        module = {"churn": churn, "goodput": goodput, "islands": islands, "sparse": sparse}[detail]
        return module.table(json.loads((tables.RESULTS / f"{detail}.json").read_text()))
    scale = json.loads((tables.RESULTS / "scale.json").read_text())
    if detail == "scale-load":
        return tables.scale_load_table(scale)
    if detail == "scale-simulated":
        return tables.scale_simulated_table(scale)
    raise ValueError(f"unknown generated table {detail!r}")


def _benchmark_summary() -> str:
    body = [
        [r.what, r.result, r.target, f"`{r.command}`", r.date[:10] or "not recorded"]
        for r in tables.rows()
    ]
    return tables.markdown_table(["what", "result", "target", "command", "date"], body)


# ---- the config reference -----------------------------------------------------------


def config_reference() -> str:
    """Markdown for every ``[section]`` of the node config and each of its keys."""
    from node.config import AtollConfig

    sections = typing.get_type_hints(AtollConfig)
    out = []
    for field in dataclasses.fields(AtollConfig):
        cls = sections[field.name]
        out.append(f"### `[{field.name}]`\n")
        summary = _rst((inspect.getdoc(cls) or "").split("\n\n")[0])
        if summary:
            out.append(summary + "\n")
        notes = _field_notes(cls)
        hints = _hints(cls)
        body = [
            [
                f"`{f.name}`",
                _type_text(hints.get(f.name, f.type), f),
                _default_text(f),
                notes.get(f.name, ""),
            ]
            for f in dataclasses.fields(cls)
        ]
        out.append(tables.markdown_table(["key", "type", "default", "description"], body))
    return "\n".join(out)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation only a type checker resolves
        return {}


def _field_notes(cls: type) -> dict[str, str]:
    """Each field's description: the string literal after it in the class body, else
    its entry in the class docstring's ``Attributes:`` section."""
    notes = _attribute_section(inspect.getdoc(cls) or "")
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            notes[stmt.target.id] = _rst(inspect.cleandoc(after.value.value))
    return notes


def _attribute_section(doc: str) -> dict[str, str]:
    notes: dict[str, list[str]] = {}
    inside, current = False, None
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^ {4}(\w+): (.*)$", line) if inside else None
        if match:
            current = match.group(1)
            notes[current] = [match.group(2)]
        elif inside and current and line.strip():
            notes[current].append(line.strip())
    return {k: _sentence(" ".join(v)) for k, v in notes.items()}


def _sentence(text: str) -> str:
    text = _rst(text)
    return text[:1].upper() + text[1:]


def _rst(text: str) -> str:
    """reStructuredText roles and literals as Markdown, on one line."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.replace("``", "`").split())


def _type_text(hint: Any, field: dataclasses.Field) -> str:
    if typing.get_origin(hint) is typing.Literal:
        text = "one of " + ", ".join(f"`{a}`" for a in typing.get_args(hint))
    else:
        name = hint if isinstance(hint, str) else _hint_name(hint)
        text = f"`{name}`"
    bounds = _bounds(field)
    return f"{text}, {bounds}" if bounds else text


def _hint_name(hint: Any) -> str:
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return re.sub(r"\b(typing|builtins)\.", "", str(hint)).replace("NoneType", "None")


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _bounds(field: dataclasses.Field) -> str:
    info = field.default
    found = []
    for meta in getattr(info, "metadata", []) if _is_field_info(info) else []:
        for attr, sign in _BOUNDS.items():
            if getattr(meta, attr, None) is not None:
                found.append(f"{sign} {_number(getattr(meta, attr))}")
        for attr, sign in (("min_length", "≥"), ("max_length", "≤")):
            if getattr(meta, attr, None) is not None:
                found.append(f"length {sign} {getattr(meta, attr)}")
    return ", ".join(found)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else f"{value:,}"


def _is_field_info(value: Any) -> bool:
    return type(value).__name__ == "FieldInfo"  # pydantic's Field(...)


def _default_text(field: dataclasses.Field) -> str:
    value: Any = field.default
    if _is_field_info(value):
        factory = value.default_factory
        value = factory() if factory is not None else value.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    if value is dataclasses.MISSING:
        return "(required)"
    return f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, int) and abs(value) >= 10**6:
        return f"{value:_}"
    return f"{value:g}" if isinstance(value, float) else str(value)
