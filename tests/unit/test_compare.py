"""``python -m fedvlm.experiments.compare``: two rows of a sweep folder, paired by seed, with the
interval the board would give a headline; a row or figure the folder lacks is named, not guessed."""

from __future__ import annotations

import csv

import pytest

from fedvlm.experiments import stats
from fedvlm.experiments.compare import main

A = {0: 0.33, 1: 0.34, 2: 0.325, 3: 0.331}
B = {0: 0.22, 1: 0.21, 2: 0.225, 3: 0.20}


def _folder(tmp_path):
    rows = [("a", "8", s, "finished", v) for s, v in A.items()] + [("b", "8", s, "finished", v) for s, v in B.items()]
    rows += [("b", "8", 4, "failed", ""), ("b", "none", 0, "finished", 0.9)]  # neither counts against a@8
    with open(tmp_path / "summary.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["variant", "epsilon", "seed", "status", "neighbor-acc-last10-mean", "neighbor-acc"])
        w.writerows([(*r, 0.5 if r[0] == "a" else 0.4) for r in rows])  # the last round's: a leads by 10
    return tmp_path


def test_two_rows_are_paired_by_seed_with_the_boards_interval(tmp_path, capsys):
    assert main([str(_folder(tmp_path)), "a@8", "b@8", "neighbor-acc"]) == 0
    d = stats.difference(A, B)
    said = capsys.readouterr().out
    assert d.interval(100.0) in said and "paired by seed, 4 seeds" in said
    assert d.low > 0  # a real lead, here
    assert main([str(tmp_path), "a@8", "b@8", "neighbor-acc", "--final"]) == 0  # the last round's column
    assert "neighbor-acc: +10.00 [+10.00, +10.00]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["a8", "b@8", "neighbor-acc"], "a row is variant@epsilon"),
        (["a@8", "c@8", "neighbor-acc"], "c@8: no finished run"),
        (["a@8", "b@8", "local-acc"], "its figures are neighbor-acc"),
        (["a@8", "b@8", "neighbor-acc-last10-mean", "--final"], "--final: neighbor-acc-last10-mean is a column"),
    ],
)
def test_a_row_or_figure_the_folder_lacks_is_named(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit):
        main([str(_folder(tmp_path)), *argv])
    assert named in capsys.readouterr().err


def test_b_may_come_from_another_folder(tmp_path, capsys):
    """A board's reference rows live in its dp-compute folder: b read there, paired with a."""
    _folder(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    with open(other / "summary.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["variant", "epsilon", "seed", "status", "neighbor-acc-last10-mean"])
        w.writerows(("c", "none", s, "finished", v) for s, v in B.items())
    assert main([str(tmp_path), "a@8", "c@none", "neighbor-acc", "--b-folder", str(other)]) == 0
    assert stats.difference(A, B).interval(100.0) in capsys.readouterr().out
    with pytest.raises(SystemExit):  # c is not in a's folder
        main([str(tmp_path), "a@8", "c@none", "neighbor-acc"])


def test_a_figure_after_a_given_round_is_read_from_the_runs_themselves(tmp_path, capsys):
    """``--round N``: a longer run read at a shorter protocol's last round (FedRand's 50-round runs at
    round 30), each seed's figure from its own results.json; a round a run never reached, or did not
    evaluate, is named."""
    import json

    from fedvlm.experiments.sweep import run_name

    _folder(tmp_path)
    at_two = {"a": {s: v + 0.05 for s, v in A.items()}, "b": B}
    for variant, seeds in at_two.items():
        for seed, value in seeds.items():
            run = tmp_path / "runs" / run_name(variant, "8", seed)
            run.mkdir(parents=True)
            # round 3 was not evaluated (evaluate-every): no figure
            rounds = [{"round": k, "metrics": {"neighbor-acc": value if k == 2 else 0.0}} for k in (1, 2)]
            rounds.append({"round": 3, "metrics": {}})
            (run / "results.json").write_text(json.dumps({"run": {}, "config": {}, "rounds": rounds}))
    assert main([str(tmp_path), "a@8", "b@8", "neighbor-acc", "--round", "2"]) == 0
    said = capsys.readouterr().out
    assert f"neighbor-acc after round 2: {stats.difference(at_two['a'], B).interval(100.0)}" in said
    for argv, named in (
        (["--round", "4"], "has 3 rounds"),
        (["--round", "3"], "not evaluated"),
        (["--round", "0"], "a round from 1 on"),
        (["--round", "2", "--final"], "without --final"),
    ):
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path), "a@8", "b@8", "neighbor-acc", *argv])
        assert named in str(stop.value) + capsys.readouterr().err
