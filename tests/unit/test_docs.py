"""The documentation holds together: the README stays a doorway, every relative link and anchor
in the README and docs/ resolves, and docs/configuration.md's key table is the schema's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedvlm.experiments.leaderboard import MATCHED, MATCHED_DIR
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


CODE = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"^([\w.-]+/[\w./-]+\.(?:py|md|toml|yml|txt|json|csv|sh))(?::\w+)?$")
MEMBER = re.compile(r"^([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)(?:\(.*\))?$")


def _package_names() -> tuple[set[str], set[str], dict[str, set[str]]]:
    """(modules, top-level names, class -> its attributes) of the package, read from its source."""
    import ast

    modules, names, classes = set(), set(), {}
    for path in (ROOT / "fedvlm").rglob("*.py"):
        modules.add(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names.update(x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name))
            if isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                for inner in ast.walk(node):
                    if isinstance(inner, ast.FunctionDef):
                        attrs.add(inner.name)
                    elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                        attrs.add(inner.target.id)
                    elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                        attrs.add(inner.attr)
                    elif isinstance(inner, ast.Assign):
                        attrs.update(t.id for t in inner.targets if isinstance(t, ast.Name))
    return modules, names, classes


def _stale_names(pages: list[Path]) -> list[str]:
    """Code the docs quote that is not in the repository: a file path, a ``fedvlm.module[:name]``,
    a ``Class.member`` of one of the package's classes."""
    modules, names, classes = _package_names()
    stale = []
    for page in pages:
        for quoted in CODE.findall(page.read_text()):
            quoted = quoted.strip()
            where = f"{page.name}: `{quoted}`"
            if m := FILE.match(quoted):
                homes = (ROOT, ROOT / "fedvlm", ROOT / "docs", ROOT / "docker", page.parent)
                if not any((home / m[1]).exists() for home in homes):
                    stale.append(where)
            elif m := MEMBER.match(quoted):
                if m[1] in classes and m[2] not in classes[m[1]]:
                    stale.append(where)
            elif re.match(r"^fedvlm\.[\w.]+(:\w+)?$", quoted):
                module, _, name = quoted.partition(":")
                parts = module.split(".")
                known = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), 0)
                rest = [*parts[known:], *([name] if name else [])]
                if not known or not all(p in names for p in rest):
                    stale.append(where)
    return stale


def test_every_name_the_docs_quote_exists():
    """Issue 46: docs showed a class where the field is a path string and named members that had
    moved; a file, module or member quoted in the README or docs/ must be in the repository
    (docs/results/ records what was measured then, and is left as it was)."""
    assert _stale_names([p for p in PAGES if "results" not in p.relative_to(ROOT).parts]) == []


def test_the_stale_name_rule_sees_one(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("`fedvlm/nope.py`, `fedvlm.privacy.nope`, `RunBudget.nope`, `RunBudget.charge_round`\n")
    assert len(_stale_names([page])) == 3


def _board_runs(board: dict) -> list[Path]:
    """The run folders a published board's rows were made of, where the board's command put them:
    ``<family>/runs/<variant>-eps<epsilon>-seed<s>``, a ``-dpcompute`` row's in ``<family>/dp-compute``."""
    home = ROOT / "docs" / "results" / "leaderboard-runs"
    runs = []
    for row in board["entries"]:
        family = home / row["family"] / (MATCHED_DIR if row["variant"].endswith(MATCHED) else "")
        runs += [family / "runs" / f"{row['variant']}-eps{row['epsilon']}-seed{s}" for s in row["seed-list"]]
    return runs


def test_every_run_the_published_board_is_made_of_is_in_the_checkout():
    """Issue 62's review: the board's `-dpcompute` references (``prompt/dp-compute``) were kept out
    of git by a .gitignore that kept results one folder deep, so every PromptFL and pFedMoAP
    private row's difference rested on runs a fresh clone did not have (and would make again at
    other seeds). Run on a clean checkout, this sees only what is committed."""
    board = json.loads((ROOT / "docs" / "results" / "leaderboard.json").read_text())
    runs = _board_runs(board)
    assert len(runs) >= 180 and any(MATCHED_DIR in run.parts for run in runs)
    missing = [str(run.relative_to(ROOT)) for run in runs if not (run / "results.json").is_file()]
    assert missing == []
    summaries = {run.parents[1] / "summary.csv" for run in runs}
    assert [str(s.relative_to(ROOT)) for s in summaries if not s.is_file()] == []
