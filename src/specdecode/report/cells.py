"""The report's cells: how a number, an interval or a size is written, and a table's column
(drawn by one template macro). Shared by the report's sections (report.html, figures, targets,
audit)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.report.analysis import Interval

DASH = "\u2013"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Column:
    """One column of a report table: the row's `key` it shows, its header, whether it holds
    text (left-aligned), the row key holding its cells' CSS class (if any), and the glossary
    entry its header links to (`term-<term>` in the page; "" for none). Every table of the
    report is drawn from its columns by the template's one macro, `data_table`."""

    key: str
    header: str
    text: bool = False
    css: str = ""
    term: str = ""
    wrap: bool = False  # long text: may break anywhere rather than widen the table


def num(x: float | None, digits: int = 2) -> str:
    return DASH if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def ci(iv: Interval | None) -> str:
    if iv is None or not math.isfinite(iv.estimate):
        return DASH
    return f"{iv.estimate:.2f}x [{num(iv.low)}, {num(iv.high)}]"


def pair(a: float, b: float, scale: float, digits: int) -> str:
    return f"{num(a * scale, digits)} / {num(b * scale, digits)}"


def fmt_bytes(n: int) -> str:
    """Bytes in binary units (MiB, GiB), or a dash for 0."""
    if n <= 0:
        return DASH
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.1f} {unit}"


