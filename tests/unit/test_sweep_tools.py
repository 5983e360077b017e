"""The sweep's presets, comparison sets and tables (no federation runs: see
tests/integration/test_sweep.py for one)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fedvlm.experiments.presets import COMPARISONS, PRESETS
from fedvlm.experiments.sweep import _labelled, cost_row, idle_rounds
from fedvlm.experiments.sweep_report import audit_row, plot_audit, write_audit, write_tables
from fedvlm.methods.validation import validate
from fedvlm.metrics import TRAIN_CLIENTS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_validates(preset, tmp_path):
    base = {k: v for k, v in PRESETS[preset].items() if not k.startswith("_")}
    variants = COMPARISONS["pfedmoap"] if "pfedmoap" in preset else [("dpfpl", "dpfpl", {})]
    for label, method, overrides in variants:
        cfg = validate({**base, **overrides, "method": method, "data-root": str(tmp_path)})
        assert cfg.method == method, label


def test_pfedmoap_presets_are_the_papers_setups():
    dtd = PRESETS["paper-pfedmoap-dtd"]
    assert (dtd["clip.model"], dtd["max-per-class"], dtd["num-server-rounds"], dtd["prompt.local-epochs"]) == (
        "RN50",
        16,
        10,
        5,
    )
    cifar = PRESETS["paper-pfedmoap-cifar100"]
    assert (cifar["_clients"], cifar["fraction-train"], cifar["partitioner"], cifar["dirichlet-alpha"]) == (
        100,
        0.1,
        "dirichlet",
        0.5,
    )
    # Table 1's DTD row and Table 6's epsilon-25 row reach the reference column.
    assert dtd["_reference"][("pfedmoap", "none")] == 89.13
    assert dtd["_reference"][("promptfl", "25")] == 38.19
    labels = [label for label, _, _ in COMPARISONS["pfedmoap"]]
    assert labels == ["zeroshot", "coop", "promptfl", "promptfl+fedprox", "fedotp", "pfedmoap-lambda0", "pfedmoap"]


def test_labelled_variants_parse_and_refuse_typos():
    assert _labelled([["l0", "pfedmoap", "pfedmoap.lambda=0", "pfedmoap.k=3"]]) == [
        ("l0", "pfedmoap", {"pfedmoap.lambda": 0, "pfedmoap.k": 3})
    ]
    with pytest.raises(SystemExit, match="pfedmoap.lamda=0"):
        _labelled([["l0", "pfedmoap", "pfedmoap.lamda=0"]])
    with pytest.raises(Exception, match="not a known method"):
        _labelled([["x", "pfedmoapp"]])


def test_final_table_puts_the_papers_number_beside_ours(tmp_path):
    rows = [
        {"variant": "pfedmoap", "epsilon": "none", "local-acc": 0.5, "local-acc-last10-mean": 0.4},
        {"variant": "pfedmoap", "epsilon": "none", "local-acc": 0.7, "local-acc-last10-mean": 0.6},
        {"variant": "coop", "epsilon": "none", "local-acc": 0.3, "local-acc-last10-mean": 0.3},
    ]
    for r in rows:
        r["neighbor-acc-last10-mean"] = None
    write_tables(rows, tmp_path, ["none"], {("pfedmoap", "none"): 98.41})
    lines = (tmp_path / "table_final.md").read_text().splitlines()
    assert lines[2] == "| method | eps=none | paper eps=none |"
    assert lines[4] == "| pfedmoap | 60.00 ± 14.14 | 98.41 |"  # std over seeds, ddof 1
    assert lines[5] == "| coop | 30.00 | - |"


def test_audited_runs_get_their_table_and_plot(tmp_path):
    results = {
        "audit": {
            "nodes": {
                "client-0": {
                    "canaries": 100,
                    "guesses": 50,
                    "correct": 31,
                    "epsilon_lower": 0.21,
                    "accounted_epsilon": 1.0,
                    "accounted_epsilon_audited_mechanism": 0.8,
                    "status": "consistent: ...",
                }
            }
        }
    }
    rows = [
        {"variant": "dpfpl", "epsilon": "1", "seed": 0, **audit_row(results)},
        {"variant": "coop", "epsilon": "none"},
    ]
    write_audit(rows, tmp_path)
    plot_audit(rows, tmp_path)
    table = (tmp_path / "table_audit.md").read_text()
    assert "| dpfpl | 1 | 0 | 1.000 | 0.800 | 0.210 | 50 | 31 | consistent |" in table and "coop" not in table
    assert (tmp_path / "audit_vs_accounted.png").stat().st_size > 0
    assert audit_row({"final": {}}) == {}  # a run without an audit adds nothing


def test_attacks_with_intervals_get_their_table_and_tpr_plot(tmp_path):
    from fedvlm.attacks.likelihood import bootstrap
    from fedvlm.experiments.attack_report import attack_row, plot_attacks, write_attack_table

    rng = np.random.default_rng(0)
    member = np.r_[np.ones(200, bool), np.zeros(200, bool)]
    leaky = bootstrap(rng.normal(0, 1, 400) + 1.5 * member, member)  # separates
    blind = bootstrap(rng.normal(0, 1, 400), member)  # chance
    rows = [
        {"variant": "dpfpl", "epsilon": "none", "seed": 0, "epsilon-spent": None, **attack_row({"lira-online": leaky})},
        {"variant": "dpfpl", "epsilon": "1", "seed": 0, "epsilon-spent": 0.9, **attack_row({"lira-online": blind})},
        {"variant": "dpfpl", "epsilon": "8", "seed": 0, "epsilon-spent": 7.5, "mia-shokri-auc": 0.5},
    ]
    assert rows[0]["mia-lira-online-auc-lo"] > 0.5 and "mia-lira-online-tpr@1%fpr-hi" in rows[1]
    write_attack_table(rows, tmp_path, "test prompts")
    lines = (tmp_path / "table_attacks.md").read_text().splitlines()
    no_dp, eps1, eps8 = ([c.strip() for c in line.strip("|").split("|")] for line in lines[-3:])
    # columns: variant, epsilon, seed, accounted eps, AUC, TPR@1%FPR, TPR@0.1%FPR
    assert no_dp[3] == "no DP" and no_dp[4].endswith("*") and no_dp[5].endswith("*")  # intervals above chance
    assert eps1[3] == "0.900" and not eps1[4].endswith("*")  # the AUC interval covers chance
    assert eps8[4:] == ["-", "-", "-"]  # a run without interval attacks: empty cells
    plot_attacks(rows, tmp_path)
    assert (tmp_path / "attack_tpr_vs_epsilon.png").stat().st_size > 0
    assert attack_row({"shokri": {"auc": 0.6}}) == {}  # point estimates without intervals are not rows
    stale = {"auc": {"value": 0.49, "ci95": [0.47, 0.52]}}  # a report from before figures had their chance
    with pytest.raises(ValueError, match="before each attack figure carried its chance level: run it again"):
        attack_row({"lira-offline": stale})


def test_an_attack_point_is_the_mean_over_its_targets_seeds():
    from fedvlm.experiments.attack_report import target_points

    key = "mia-lira-offline-tpr@0.1%fpr"

    def row(eps, seed, spent, tpr, chance=0.002):
        figure = {key: tpr, key + "-lo": 0.0, key + "-hi": 2 * tpr, key + "-chance": chance}
        return {"epsilon": eps, "seed": seed, "epsilon-spent": spent, **figure}

    rows = [row("8", 0, 6.0, 0.01), row("8", 1, 5.0, 0.03, 0.004), row("none", 0, None, 0.02), row("1", 0, 0.8, 0.0)]
    points = target_points(rows, key, no_dp_x=40.0)
    expected = [(0.8, 0.0, 0.0, 0.0, 0.002), (5.5, 0.02, 0.0, 0.04, 0.003), (40.0, 0.02, 0.0, 0.04, 0.002)]
    assert [pytest.approx(p) for p in points] == expected


def test_a_family_whose_utility_is_cider_gets_its_own_tables(tmp_path):
    """The VLM methods report CIDEr, not accuracy: a table per CIDEr figure, unscaled, and no
    accuracy tables of dashes."""
    from fedvlm.experiments.sweep_report import write_tables

    rows = [
        {"variant": "fedrand", "epsilon": e, "seed": s, "status": "finished", "client-cider-last10-mean": c}
        for e, s, c in (("none", 0, 350.0), ("none", 1, 450.0), ("8", 0, 140.0))
    ]
    assert write_tables(rows, tmp_path, ["none", "8"]) == ["client-cider"]
    lines = (tmp_path / "table_client-cider.md").read_text().splitlines()
    assert lines[0] == "Mean of the last 10 rounds, client-cider (CIDEr x100), mean ± std over seeds"
    assert lines[-1] == "| fedrand | 400.00 ± 70.71 | 140.00 |"
    assert not (tmp_path / "table_local.md").exists() and not (tmp_path / "table_final.md").exists()


def test_the_utility_plot_leaves_out_a_seed_that_finished_no_round(tmp_path):
    from fedvlm.experiments.sweep_report import plot

    rows = [
        {"variant": "dpfpl", "epsilon": "1", "seed": 0, "local-acc-last10-mean": 0.4},
        {"variant": "dpfpl", "epsilon": "1", "seed": 1, "local-acc-last10-mean": None},  # stopped before round 1
        {"variant": "dpfpl", "epsilon": "none", "seed": 0},
    ]
    plot(rows, tmp_path, ["none", "1"])
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 0
    # two seeds of an attack: its point carries the seeds' interval, beside a labelled chance line
    for r, acc in zip(rows[:2], (0.52, 0.56), strict=True):
        r.update({"mia-shokri-acc": acc, "mia-loss-acc": acc, "local-acc-last10-mean": 0.4})
    plot(rows, tmp_path, ["none", "1"])
    assert (tmp_path / "mia_vs_epsilon.png").stat().st_size > 0


def test_a_finished_run_whose_attack_report_predates_chance_levels_is_run_again(tmp_path):
    """The board's published runs keep no prompts, so a report written before each figure carried
    its chance level cannot be attacked afresh: the sweep runs such a run again (``Sweep.old_attacks``
    decides; the run is then set aside like a run of another config), and keeps a current one."""
    from fedvlm.attacks.likelihood import bootstrap
    from fedvlm.attacks.reports import MIA
    from fedvlm.experiments.sweep import Sweep

    member = np.r_[np.ones(100, bool), np.zeros(100, bool)]
    current = bootstrap(np.random.default_rng(0).normal(0, 1, 200), member)
    old = {m: {k: v for k, v in f.items() if k != "chance"} if isinstance(f, dict) else f for m, f in current.items()}
    for name, pooled in (("current", current), ("old", old)):
        (tmp_path / name).mkdir()
        (tmp_path / name / MIA).write_text(json.dumps({"summary": {"lira-offline": {"auc": 0.5, "pooled": pooled}}}))
    assert Sweep.old_attacks("promptfl", tmp_path / "old")
    assert not Sweep.old_attacks("promptfl", tmp_path / "current")
    assert not Sweep.old_attacks("promptfl", tmp_path / "never-attacked")  # no report: attacked as usual


def test_a_round_held_up_by_a_paused_machine_sets_neither_the_speed_nor_passes_for_training():
    def round_(n: int, seconds: float, trained: int) -> dict:
        return {"round": n, "sampled": 10, "seconds": seconds, "metrics": {TRAIN_CLIENTS: trained}, "clients": {}}

    data = {"run": {"nodes": [{"info": {"device": "cpu"}}] * 10}, "final": {}, "config": {}}
    data["rounds"] = [round_(1, 1.0, 10), round_(2, 900.0, 10), round_(3, 1.2, 10)]
    row = cost_row(data)
    assert row["seconds-per-round"] == 1.2 and row["seconds-total"] == pytest.approx(902.2)
    assert idle_rounds(data) == []  # held up, but every sampled node trained: the run is whole
    data["rounds"][1]["metrics"][TRAIN_CLIENTS] = 0  # every reply of round 2 lost
    assert idle_rounds(data) == [2]


def test_a_table_is_written_whole_and_reads_as_the_records_it_holds(tmp_path):
    """Issue 62's review: summary.csv (a board's input), the sweep's tables and plots were written in
    place, so a board reading one while a sweep rewrote it could see half a file. Every key any
    record has is a column, a missing or None value an empty cell, and a write that fails half-way
    leaves the file before it as it was, and no temporary file."""
    import csv

    from fedvlm.utils import files

    path = tmp_path / "summary.csv"
    records = [{"variant": "a", "eps": 8, "tpr": None}, {"variant": "b", "seed": 2}]
    files.atomic_write_records(records, path)
    with open(path, newline="") as fh:
        assert list(csv.DictReader(fh)) == [
            {"variant": "a", "eps": "8", "tpr": "", "seed": ""},
            {"variant": "b", "eps": "", "tpr": "", "seed": "2"},
        ]
    before = path.read_bytes()

    class Figure:  # a plot that fails half-way through its PNG
        def savefig(self, fh, **kwargs):
            fh.write(b"\x89PNG half")
            raise OSError("disk full")

    plot = tmp_path / "plot.png"
    plot.write_bytes(before)
    with pytest.raises(OSError):
        files.atomic_savefig(Figure(), plot, 110)
    assert plot.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "summary.csv"]


def test_a_folder_set_aside_is_held_until_renamed_and_a_live_runs_is_refused(tmp_path, monkeypatch):
    """Issue 62's review: ``set_aside`` let go of a run folder's lock before renaming it, so a
    ServerApp starting that run in between could take the folder and have it renamed under it."""
    from pathlib import Path

    from fedvlm.experiments import sweep
    from fedvlm.utils.files import try_hold

    run = tmp_path / "runs" / "p-eps8-seed0"
    run.mkdir(parents=True)
    (run / "results.json").write_text("{}")
    live = try_hold(run / sweep.RUN_LOCK)  # another board's ServerApp running it now
    with pytest.raises(RuntimeError, match="being run now"):
        sweep.set_aside(run, "other-config")
    assert (run / "results.json").exists()
    live.close()

    rename = Path.rename
    free_during_rename = []

    def watched(self, target):
        other = try_hold(self / sweep.RUN_LOCK)  # what a ServerApp starting the run now would try
        free_during_rename.append(other is not None)
        if other is not None:
            other.close()
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", watched)
    sweep.set_aside(run, "other-config")
    assert free_during_rename == [False] and not run.exists()
    assert [p.name.startswith("p-eps8-seed0-other-config-") for p in run.parent.iterdir()] == [True]


def test_a_sweep_stopped_half_way_leaves_the_folders_earlier_rows_in_its_summary(tmp_path):
    """A protocol's call killed after its first run (before its caller merged the rows back) once
    left summary.csv with that run's row alone: the folder's 45 earlier rows were gone from it.
    The sweep now writes back, with every report, every row it found, until it has its own row
    for that run (a call that runs a folder's seeds again, stopped half-way, keeps the rest)."""
    from fedvlm.experiments.sweep import _parser, _prepare
    from fedvlm.experiments.sweep_report import summary_rows

    (tmp_path / "summary.csv").write_text(
        "variant,method,epsilon,seed,status,local-acc\n"
        "coop,coop,none,0,finished,0.7\n"  # another call's: kept
        "promptfl,promptfl,none,1,finished,0.3\n"  # planned again below: the sweep's to replace
    )
    p = _parser()
    argv = ["--out", str(tmp_path), "--methods", "promptfl", "--epsilons", "none", "--seeds", "1,2"]
    sweep = _prepare(p, p.parse_args(argv))
    sweep.report()  # as after a first run that failed, or before any finished
    assert [(r["variant"], r["seed"]) for r in summary_rows(tmp_path / "summary.csv")] == [
        ("coop", "0"),
        ("promptfl", "1"),
    ]
    sweep.rows.append({"variant": "promptfl", "method": "promptfl", "epsilon": "none", "seed": 1, "status": "ok"})
    sweep.report()
    rows = summary_rows(tmp_path / "summary.csv")
    assert [(r["variant"], r["seed"], r["status"]) for r in rows] == [
        ("promptfl", "1", "ok"),
        ("coop", "0", "finished"),
    ]


def test_an_earlier_calls_row_is_read_again_from_its_finished_run(tmp_path):
    """clients-50's page named PromptFL's and pFedMoAP's rows as mixing two backbones, though every
    run recorded one: their seeds 3-4 were made by an earlier call, whose rows predate the weights'
    column, and each later call wrote them back as they were, that cell empty. A kept row's run
    columns are now read again from its finished run; its attack columns, a failed row and a row
    whose run is gone stay as written."""
    import json

    from fedvlm.experiments.sweep import _parser, _prepare
    from fedvlm.experiments.sweep_report import LAST10, summary_rows

    (tmp_path / "summary.csv").write_text(
        "variant,method,epsilon,seed,status,local-acc,mia-auc\n"
        "promptfl,promptfl,none,3,finished,0.3,0.51\n"  # its run below records its weights
        "coop,coop,none,0,finished,0.7,\n"  # its run folder is gone: as written
        "fedotp,fedotp,none,0,failed,,\n"
    )
    run = tmp_path / "runs" / "promptfl-epsnone-seed3"
    run.mkdir(parents=True)
    record = {
        "run": {"status": "finished", "backbone": {"fingerprint": "embedded-tiny:gelu:sha256:ab"}, "nodes": [{}]},
        "config": {},
        "final": {"local-acc": 0.25, "local-acc" + LAST10: 0.2},
        "rounds": [{"round": 1, "seconds": 2.0, "clients": {}, "metrics": {}}],
    }
    (run / "results.json").write_text(json.dumps(record))
    p = _parser()
    argv = ["--out", str(tmp_path), "--methods", "promptfl", "--epsilons", "none", "--seeds", "3"]
    sweep = _prepare(p, p.parse_args(argv))
    sweep.report()  # the call's own run has no row yet: every earlier row written back
    rows = {r["variant"]: r for r in summary_rows(tmp_path / "summary.csv")}
    assert rows["promptfl"]["backbone"] == "embedded-tiny:gelu:sha256:ab"
    assert rows["promptfl"]["local-acc"] == "0.25" and rows["promptfl"]["mia-auc"] == "0.51"
    assert rows["coop"]["backbone"] == "" and rows["coop"]["local-acc"] == "0.7"
    assert rows["fedotp"]["status"] == "failed"
    sweep.rows.append({"variant": "promptfl", "method": "promptfl", "epsilon": "none", "seed": 3, "status": "ok"})
    sweep.report()  # the call's own row replaces the one read again: one row a run
    rows = summary_rows(tmp_path / "summary.csv")
    assert [(r["variant"], r["status"]) for r in rows] == [
        ("promptfl", "ok"),
        ("coop", "finished"),
        ("fedotp", "failed"),
    ]


def test_a_variants_own_audit_setting_wins_over_the_sweeps(tmp_path):
    """pFedMoAP's 'upload' placement noises a round's update once, with no per-record step for a
    canary to enter, so its config refuses canaries; the sweep's --audit used to overwrite the
    variant's privacy.audit-canaries = 0 and every such run was refused."""
    from fedvlm.experiments.sweep import _parser, _prepare

    p = _parser()
    argv = ["--epsilons", "8", "--audit", "100", "--variant", "up", "pfedmoap", "pfedmoap.dp-placement=upload"]
    argv += ["privacy.audit-canaries=0", "--variant", "step", "pfedmoap"]
    sweep = _prepare(p, p.parse_args(["--out", str(tmp_path), *argv]))
    raws = {e[0]: sweep.raw(*e) for e in sweep.plan}
    assert raws["up"]["privacy.audit-canaries"] == 0 and raws["step"]["privacy.audit-canaries"] == 100
    validate(raws["up"])  # accepted: the refusal the sweep once caused is gone


def test_a_second_sweep_into_a_folder_in_use_is_refused_before_it_touches_anything(tmp_path, capsys):
    """Issue 62's review: two sweeps into one --out each wrote summary.csv with their own rows and
    the rows they read at their start, so the last writer dropped the other's; and a second one
    could set aside a run folder the first was still attacking. The folder is one sweep's at a time."""
    from fedvlm.experiments import sweep
    from fedvlm.utils.files import try_hold

    (tmp_path / "summary.csv").write_text("variant,method,epsilon,seed,status\npromptfl,promptfl,none,0,finished\n")
    before = (tmp_path / "summary.csv").read_bytes()
    held = try_hold(tmp_path / sweep.SWEEP_LOCK)
    try:
        with pytest.raises(SystemExit):
            sweep.main(["--out", str(tmp_path), "--methods", "zeroshot", "--epsilons", "none"])
    finally:
        held.close()
    err = capsys.readouterr().err
    assert f"another sweep (process {os.getpid()})" in err and "another --out" in err
    assert (tmp_path / "summary.csv").read_bytes() == before and not list((tmp_path / "runs").iterdir())
