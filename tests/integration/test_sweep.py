"""One small sweep through the real sweep tool: labelled variants, a method without DP kept at
'none', finished runs reused (only where they are the run asked for), the tables written."""

from __future__ import annotations

import csv
import json

from fedvlm.experiments.sweep import main
from fedvlm.metrics import TRAIN_CLIENTS


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
    # a damaged results.json (truncated, binary, a list) is that run's failed row, named, left as
    # it was; the sweep goes on to the next run and writes its tables (it ended in a traceback)
    for body, words in ((b'{"run": ', "not valid UTF-8 JSON"), (b"\xff\xfe", "not valid UTF-8"), (b"[]", "JSON list")):
        (out / "runs" / "zs-epsnone-seed0" / "results.json").write_bytes(body)
        assert main(argv) == 1  # every row failed: the sweep says so, after writing its tables
        rows = {r["variant"]: r for r in csv.DictReader((out / "summary.csv").open())}
        assert rows["zs"]["status"] == "failed" and "zs-epsnone-seed0/results.json" in rows["zs"]["error"]
        assert words in rows["zs"]["error"] and "move that run folder away" in rows["zs"]["error"]
        assert (out / "runs" / "zs-epsnone-seed0" / "results.json").read_bytes() == body


def test_the_papers_numbers_appear_only_for_the_papers_setup():
    from fedvlm.experiments.presets import setup

    base, clients, reference = setup("paper-pfedmoap-dtd", [], None)
    assert reference and clients == 10 and base["clip.model"] == "RN50"
    for sets, n in ((["clip.model=ViT-B-16"], None), (["dataset=embedded"], None), ([], 4)):
        base, clients, reference = setup("paper-pfedmoap-dtd", sets, n)
        assert reference is None, sets
    assert setup("paper-pfedmoap-dtd", [], 4)[1] == 4  # --clients is honoured, never silently overridden
    assert setup("paper-pfedmoap-dtd", ["seed=3"], None)[2]  # a seed does not change the setup


def test_a_cut_off_run_is_resumed_and_one_that_cannot_be_is_kept_aside(
    tmp_path, cache_dir, pretrained_clip, monkeypatch
):
    def sweep(out, rounds):
        argv = ["--out", str(out), "--variant", "p", "promptfl", "--epsilons", "none", "--clients", "3"]
        assert main([*argv, "--set", f"num-server-rounds={rounds}", "max-per-class=4", f"cache-dir={cache_dir}"]) == 0
        return json.loads((out / "runs" / "p-epsnone-seed0" / "results.json").read_text())

    def cut_off(out):  # what a killed ServerApp leaves: its last results.json still says 'running'
        path = out / "runs" / "p-epsnone-seed0" / "results.json"
        data = json.loads(path.read_text())
        data["run"]["status"] = "running"
        path.write_text(json.dumps(data))

    out = tmp_path / "cut"
    sweep(out, 1)
    cut_off(out)
    resumed = sweep(out, 2)
    # resumed in place: no stamped sibling, both rounds in the one folder
    assert [p.name for p in (out / "runs").iterdir()] == ["p-epsnone-seed0"]
    assert resumed["run"]["status"] == "finished" and resumed["run"]["resumed"][0]["from_round"] == 1
    # seeded: the same figures an uninterrupted run records, so the row is one protocol with the rest
    whole = sweep(tmp_path / "whole", 2)

    def figures(run):  # every metric but the times
        return [{k: v for k, v in r["metrics"].items() if not k.endswith("seconds")} for r in run["rounds"]]

    assert len(figures(whole)) == 2 and figures(resumed) == figures(whole)
    row = next(csv.DictReader((out / "summary.csv").open()))
    assert (
        row["status"] == "finished" and float(row["local-acc-last10-mean"]) == whole["final"]["local-acc-last10-mean"]
    )

    # a folder with no checkpoint cannot be resumed: kept aside under a new name, the run starts afresh
    cut_off(out)
    (out / "runs" / "p-epsnone-seed0" / "checkpoint.pt").unlink()
    fresh = sweep(out, 2)
    aside = sorted(p.name for p in (out / "runs").iterdir() if p.name != "p-epsnone-seed0")
    assert len(aside) == 1 and aside[0].startswith("p-epsnone-seed0-running-")
    assert fresh["run"]["status"] == "finished" and "resumed" not in fresh["run"]

    # a finished run made with another config under the same name (a quick board's, another --set)
    # is not this run: kept aside, and the run is made afresh
    longer = sweep(out, 3)
    assert [r["round"] for r in longer["rounds"]] == [1, 2, 3] and "resumed" not in longer["run"]
    assert len([p for p in (out / "runs").iterdir() if p.name.startswith("p-epsnone-seed0-other-config-")]) == 1

    # a finished run in which one round trained no node (every reply lost to a paused or overloaded
    # machine) trained less than its row would say: kept aside, and the run is made afresh
    path = out / "runs" / "p-epsnone-seed0" / "results.json"
    idle = json.loads(path.read_text())
    idle["rounds"][1]["metrics"][TRAIN_CLIENTS] = 0
    path.write_text(json.dumps(idle))
    again = sweep(out, 3)
    assert [r["metrics"][TRAIN_CLIENTS] > 0 for r in again["rounds"]] == [True] * 3
    assert len([p for p in (out / "runs").iterdir() if p.name.startswith("p-epsnone-seed0-idle-round-")]) == 1
    # ... and one made just now that lost a round (the machine paused mid-run) is not published as
    # finished: its row fails, saying why and how to redo it; the next sweep sets it aside
    from fedvlm.experiments import sweep as sweep_module

    real = sweep_module.run_one

    def losing_round_two(*args, **kwargs):
        data = real(*args, **kwargs)
        data["rounds"][1]["metrics"][TRAIN_CLIENTS] = 0
        return data

    monkeypatch.setattr(sweep_module, "run_one", losing_round_two)
    argv = ["--out", str(tmp_path / "idle"), "--variant", "p", "promptfl", "--epsilons", "none", "--clients", "3"]
    assert main([*argv, "--set", "num-server-rounds=2", "max-per-class=4", f"cache-dir={cache_dir}"]) == 1
    row = next(csv.DictReader((tmp_path / "idle" / "summary.csv").open()))
    assert row["status"] == "failed" and "no node trained in round(s) 2" in row["error"], row
    monkeypatch.undo()

    # a cut-off run already past the rounds now asked for has nothing to resume to: kept aside too
    cut_off(out)
    shorter = sweep(out, 2)
    assert [r["round"] for r in shorter["rounds"]] == [1, 2] and "resumed" not in shorter["run"]
    assert len([p for p in (out / "runs").iterdir() if p.name.startswith("p-epsnone-seed0-running-")]) == 2


def test_a_pinned_sweep_reuses_runs_on_those_weights_and_sets_aside_the_others(tmp_path, cache_dir, pretrained_clip):
    """``--set backbone-fingerprint=...``: the pin changes no computation, so a finished run on
    those weights is reused as it is; one whose results say other weights (another CPU's
    embedded default) is set aside and made again here, on the pinned ones."""
    out, name = tmp_path / "pin", "p-epsnone-seed0"
    argv = ["--out", str(out), "--variant", "p", "promptfl", "--epsilons", "none", "--clients", "3", "--set"]
    base = ["num-server-rounds=1", "max-per-class=4", f"cache-dir={cache_dir}"]
    assert main([*argv, *base]) == 0
    path = out / "runs" / name / "results.json"
    made = json.loads(path.read_text())
    whole = made["run"]["backbone"]["fingerprint"]
    assert main([*argv, *base, f"backbone-fingerprint={whole.rsplit(':', 1)[-1]}"]) == 0
    assert json.loads(path.read_text())["run"]["started"] == made["run"]["started"]  # reused, not made again
    made["run"]["backbone"]["fingerprint"] = "embedded-tiny:gelu:sha256:0123456789abcdef"
    path.write_text(json.dumps(made))
    assert main([*argv, *base, f"backbone-fingerprint={whole}"]) == 0
    assert json.loads(path.read_text())["run"]["backbone"]["fingerprint"] == whole
    assert len([p for p in (out / "runs").iterdir() if p.name.startswith(f"{name}-other-backbone-")]) == 1
