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


def test_an_impossible_variant_is_refused_before_the_first_run_and_the_sweep_goes_on(
    tmp_path, cache_dir, pretrained_clip
):
    """pFedMoAP's comparison (docs/results/pfedmoap.md) used to die at FedOTP on RN50 before pFedMoAP ran (RN50 now
    gives patch tokens); a pair that still cannot run (FedOTP on a timm image tower) is refused by
    validation before the first run, the sweep goes on, and the table says so."""
    out = tmp_path / "sweep"
    argv = [
        "--out",
        str(out),
        "--variant",
        "otp-timm",
        "fedotp",
        "clip.model=convnext_base",
        "--variant",
        "zs",
        "zeroshot",
        "--epsilons",
        "none",
        "--clients",
        "2",
        "--set",
        "num-server-rounds=1",
        "max-per-class=2",
        f"cache-dir={cache_dir}",
    ]
    assert main(argv) == 0
    rows = {r["variant"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert rows["otp-timm"]["status"] == "failed" and "timm image tower" in rows["otp-timm"]["error"]
    assert rows["zs"]["status"] == "finished"
    assert not (out / "runs" / "otp-timm-epsnone-seed0").exists()  # refused before it started
    assert "| otp-timm | failed |" in (out / "table_final.md").read_text()
    assert "timm image tower" in (out / "table_failures.md").read_text()


def test_the_papers_numbers_appear_only_for_the_papers_setup():
    from fedvlm.experiments.presets import setup

    base, clients, reference = setup("paper-pfedmoap-dtd", [], None)
    assert reference and clients == 10 and base["clip.model"] == "RN50"
    for sets, n in ((["clip.model=ViT-B-16"], None), (["dataset=embedded"], None), ([], 4)):
        base, clients, reference = setup("paper-pfedmoap-dtd", sets, n)
        assert reference is None, sets
    assert setup("paper-pfedmoap-dtd", [], 4)[1] == 4  # --clients is honoured, never silently overridden
    assert setup("paper-pfedmoap-dtd", ["seed=3"], None)[2]  # a seed does not change the setup
