"""Number and table formats of the benchmark summaries (``benchmarks.tables``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = [
    "run_mode",
    "bpb",
    "kb",
    "markdown_table",
    "mb",
    "pct",
    "sci",
    "sig",
    "signed",
    "size",
    "span",
    "times",
]


def pct(share: float, digits: int = 1) -> str:
    """A share as a percentage: ``0.981`` -> ``98.1 %``."""
    return f"{share * 100:.{digits}f} %"


def sci(x: float) -> str:
    """Two significant digits in scientific notation: ``2.1e-4``."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def times(x: float) -> str:
    """A factor to one decimal: ``3.9×`` (``2×`` when whole)."""
    return f"{round(x, 1):g}×"


def signed(percent: float, digits: int = 1) -> str:
    """A signed percentage without its unit, ``0.0`` for nothing either way."""
    text = f"{percent:+.{digits}f}"
    return "0.0" if float(text) == 0 else text.replace("-", "−")


def kb(n: float) -> str:
    """Bytes as whole kilobytes."""
    return f"{n / 1e3:.0f} kB"


def mb(n: float, digits: int = 1) -> str:
    """Bytes as megabytes."""
    return f"{n / 1e6:.{digits}f} MB"


def span(values: Iterable[float], fmt: Callable[[float], str]) -> str:
    """``low–high`` of the values, or the one value when both read the same."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"


def sig(x: float) -> str:
    """Three significant digits below 100, whole numbers from 100 on."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def bpb(x: float) -> str:
    """Bits per byte: two decimals, whole numbers for a diverged run."""
    return f"{x:.0f}" if x >= 100 else f"{x:.2f}"


def size(n: int) -> str:
    """A vector length in millions: ``10M``."""
    return f"{n / 1e6:g}M"


def run_mode(data: dict) -> str:
    """``smoke``, ``quick`` or ``full``: the mode a results file was measured in."""
    return "smoke" if data.get("smoke") else "quick" if data.get("quick") else "full"


def _cell(text: str) -> str:
    # a pipe inside a code span is the code's own; outside one it would end the cell
    parts = text.split("`")
    parts[::2] = [p.replace("|", "\\|") for p in parts[::2]]
    return "`".join(parts).replace("\n", " ")


def markdown_table(header: Iterable[str], body: Iterable[Iterable[str]]) -> str:
    """A Markdown table; pipes in the cells' text (not in their code) are escaped."""
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"
