"""One small sweep through the real sweep tool: labelled variants, a method without DP kept at
'none', finished runs reused, the tables written."""

from __future__ import annotations

import csv
import json

from fedvlm.experiments.sweep import main


def test_labelled_variants_sweep_and_resume(tmp_path, cache_dir, pretrained_clip):
    out = tmp_path / "sweep"
    argv = [
        "--out",
        str(out),
        "--variant",
        "zs",
        "zeroshot",
        "--variant",
        "moap-l0",
        "pfedmoap",
        "pfedmoap.lambda=0",
        "pfedmoap.k=1",
        "--epsilons",
        "none,4",
        "--clients",
        "3",
        "--set",
        "num-server-rounds=2",
        "max-per-class=4",
        f"cache-dir={cache_dir}",
    ]
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "summary.csv").open()))
    # zero-shot has no DP mechanism: it runs at 'none' only; the pfedmoap variant at both.
    assert [(r["variant"], r["epsilon"]) for r in rows] == [("zs", "none"), ("moap-l0", "none"), ("moap-l0", "4")]
    run = json.loads((out / "runs" / "moap-l0-eps4-seed0" / "results.json").read_text())
    assert run["config"]["pfedmoap.lambda"] == 0 and run["config"]["pfedmoap.k"] == 1
    assert 0 < float(rows[2]["epsilon-spent"]) <= 4
    table = (out / "table_final.md").read_text()
    assert "| zs |" in table and "| moap-l0 |" in table and "paper" not in table

    # A second invocation reuses every finished run (the results files are not rewritten).
    stamp = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/results.json")}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/results.json")} == stamp
