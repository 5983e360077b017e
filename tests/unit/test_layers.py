"""The layer map (docs/architecture.md, "Layer map"): every module of the package has a level
(a package's ``.*`` row covers the package itself),
and no module imports one of a higher level, whoever adds the import."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_imports import _graph

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def layer_map(text: str) -> dict[str, int]:
    """The map's rows: a module pattern (``a.b``, ``a.b.*``, ``*.__main__``) -> its level."""
    section = text.split("## Layer map", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for line in section.splitlines():
        found = re.match(r"\|\s*(\d+)\s*\|(.*?)\|", line)
        if found:
            for pattern in re.findall(r"`([^`]+)`", found.group(2)):
                rows[pattern] = int(found.group(1))
    return rows


def level(module: str, rows: dict[str, int]) -> int | None:
    """The most specific row's level (an exact name, then the longest package, then a suffix)."""
    if module in rows:
        return rows[module]
    packages = [p for p in rows if p.endswith(".*") and (module + ".").startswith(p[:-1])]
    if module.endswith(".__main__") and "*.__main__" in rows:
        return rows["*.__main__"]
    return rows[max(packages, key=len)] if packages else None


def upward(graph: dict[str, set[str]], rows: dict[str, int]) -> list[str]:
    return sorted(
        f"{m} ({level(m, rows)}) -> {t} ({level(t, rows)})"
        for m, targets in graph.items()
        for t in targets
        if (level(t, rows) or 0) > (level(m, rows) or 0)
    )


def test_every_module_has_a_level():
    rows = layer_map(DOC.read_text())
    assert [m for m in sorted(_graph()) if level(m, rows) is None] == []


def test_no_module_imports_a_higher_level():
    assert upward(_graph(), layer_map(DOC.read_text())) == []


def test_the_map_catches_an_upward_import_and_a_module_it_does_not_name():
    rows = layer_map("## Layer map\n| 0 | `p.low.*` |\n| 1 | `p.high`, `*.__main__` |\n## next\n")
    graph = {"p.low.a": {"p.high"}, "p.high": {"p.low.a"}, "p.low.__main__": {"p.high"}, "p.other": set()}
    assert upward(graph, rows) == ["p.low.a (0) -> p.high (1)"]
    assert level("p.other", rows) is None and level("p.low.__main__", rows) == 1


def test_no_benchmark_edits_the_import_path():
    """A benchmark imports the installed package (and, run as ``python -m bench.NAME`` from the
    checkout, the test harnesses it measures with), never a path it put on ``sys.path`` itself."""
    bench = DOC.parents[1] / "bench"
    assert [p.name for p in sorted(bench.glob("*.py")) if "sys.path" in p.read_text()] == []
