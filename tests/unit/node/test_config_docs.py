"""Every key of every config section says what it does: the configuration reference is
generated from these descriptions (the string literal right after each field)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing

import pytest
from pydantic import Field
from pydantic.dataclasses import dataclass

from node.config import AtollConfig

SECTIONS = typing.get_type_hints(AtollConfig)


def _attribute_docs(cls: type) -> dict[str, str]:
    """``{field: the string literal right after it}`` in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _attributes_section(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``Attributes:`` section of a Google-style docstring."""
    doc = inspect.getdoc(cls) or ""
    _, found, rest = doc.partition("\nAttributes:\n")
    if not found:
        return {}
    section = re.split(r"\n\S", rest, maxsplit=1)[0]
    return dict(re.findall(r"^ {4}(\w+): (.+)$", section, re.M))


def _undocumented(cls: type) -> list[str]:
    """Fields of ``cls`` without a description. A section of the node's own config
    needs an attribute docstring; one from another package (the trust policy) may
    describe its fields in its docstring's ``Attributes:`` instead."""
    docs = _attribute_docs(cls)
    if cls.__module__.split(".")[0] not in ("node", "tests"):
        docs = {**_attributes_section(cls), **docs}
    return [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]


@pytest.mark.parametrize("name", ["atoll", *SECTIONS])
def test_every_key_of_every_section_is_described(name: str) -> None:
    cls = AtollConfig if name == "atoll" else SECTIONS[name]
    assert _undocumented(cls) == [], f"[{name}] keys without a description"


@pytest.mark.parametrize(
    "name", ["atoll", *(n for n, c in SECTIONS.items() if "node." in c.__module__)]
)
def test_descriptions_are_sentences(name: str) -> None:
    cls = AtollConfig if name == "atoll" else SECTIONS[name]
    for key, text in _attribute_docs(cls).items():
        assert text[-1] in ".)", f"{name}.{key}: {text!r} does not end a sentence"


def test_a_key_without_a_description_is_found() -> None:
    @dataclass(frozen=True)
    class Section:
        said: int = Field(default=1, ge=0)
        """What it does."""
        unsaid: float = 0.5
        also_unsaid: str = ""

    assert _undocumented(Section) == ["unsaid", "also_unsaid"]


def test_the_trust_policy_is_described_in_its_docstring() -> None:
    trust = SECTIONS["trust"]
    described = _attributes_section(trust)
    assert {f.name for f in dataclasses.fields(trust)} <= set(described)
