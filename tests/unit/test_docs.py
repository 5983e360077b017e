"""The documentation holds together: the README stays a doorway, every relative link and anchor
in the README and docs/ resolves, and docs/configuration.md's key table is the schema's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedvlm.runconfig.__main__ import with_keys_table

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchor of every heading on ``page`` (lower case, punctuation dropped, spaces to
    hyphens; a repeated heading gets -1, -2, ...)."""
    anchors, count = set(), {}
    for line in _prose(page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{count[slug]}" if slug in count else slug)
            count[slug] = count.get(slug, 0) + 1
    return anchors


def test_readme_is_a_doorway():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; results and reference belong in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_configuration_doc_is_generated_from_the_schema():
    text = (ROOT / "docs" / "configuration.md").read_text()
    fix = "python -m fedvlm.runconfig keys --write docs/configuration.md"
    assert with_keys_table(text) == text, f"docs/configuration.md's key table is out of date: {fix}"


def test_every_section_of_the_method_spec_the_code_cites_exists():
    """The code cites docs/methods.md by section (`docs/methods.md, "pFedMoAP"`): each cited
    section is a heading there, and nothing cites a spec outside the repository."""
    headings = [line[3:] for line in (ROOT / "docs" / "methods.md").read_text().splitlines() if line.startswith("## ")]
    cited = {}
    for path in [*(ROOT / "fedvlm").rglob("*.py"), *(ROOT / "docs").rglob("*.md")]:
        text = path.read_text()
        assert "METHODS.md" not in text, f"{path} cites METHODS.md, which is not in the repository"
        for name in re.findall(r"methods\.md\)?,? \"([^\"]+)\"", text):
            cited.setdefault(name, []).append(path.name)
    assert {"pFedMoAP", "FedRand", "Reprogrammable-FL"} <= set(cited), cited
    for name, where in cited.items():
        assert any(h == name or h.startswith(f"{name} (") for h in headings), (name, where, headings)
