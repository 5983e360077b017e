"""The privacy picture reads the ledger as results.json holds it: the budget line where the run
has one, a histogram past 40 nodes, the best attack where the folder holds its family's attack
report (mia.json, maxrenyi.json, global_attack.json)."""

from __future__ import annotations

import json

import matplotlib
import pytest

from fedvlm.attacks.reports import HEADLINE
from fedvlm.methods.registry import FAMILIES
from fedvlm.plots.privacy import BARS, best_attack, draw_privacy

matplotlib.use("Agg")


def _data(nodes: int, max_epsilon: float, family: str = "prompt") -> dict:
    per = [{f"client-{i}": r * (1 + i / nodes) / 10 for i in range(nodes)} for r in (1, 2, 3)]
    return {
        "run": {"family": family},
        "config": {"method": "dpfpl", "dataset": "embedded"},
        "privacy": {
            "settings": {"epsilon": 1.0, "max_epsilon": max_epsilon, "delta": 1e-5, "accountant": "rdp"},
            "rounds": [{"round": r + 1, "epsilon": max(p.values()), "per_client": p} for r, p in enumerate(per)],
        },
    }


def _pooled(tpr: float) -> dict:
    return {
        "tpr@0.1%fpr": {"value": tpr, "ci95": [0, 1], "chance": 0.004},
        "auc": {"value": 0.5 + tpr, "ci95": [0, 1], "chance": 0.5},
    }


def _mia(tprs: dict[str, float]) -> dict:
    return {
        "summary": {
            "shokri": {"accuracy": 0.5, "auc": 0.5},  # no pooled interval: not a candidate
            **{n: {"pooled": _pooled(t)} for n, t in tprs.items()},
        }
    }


def test_the_privacy_picture_shows_the_budget_the_nodes_and_the_best_attack(tmp_path):
    assert draw_privacy({"config": {}, "privacy": {}}, tmp_path) == {}  # no ledger, no picture
    expected = ["epsilon/per-record-max", "epsilon/per-record-mean", "per-node band", "target"]
    assert draw_privacy(_data(3, 0.0), tmp_path) == {"privacy.png": expected}
    (tmp_path / "mia.json").write_text(json.dumps(_mia({"lira-offline": 0.02, "rmia-offline": 0.05})))
    shown = draw_privacy(_data(BARS + 10, 2.0), tmp_path)["privacy.png"]
    assert "budget" in shown and "membership attack" in shown
    assert (tmp_path / "privacy.png").stat().st_size > 10_000


# each family's report as its attack writes it, and the attack the picture should name
REPORTS = {
    "prompt": ("mia.json", _mia({"lira-offline": 0.02, "rmia-offline": 0.05}), "rmia-offline"),
    "vlm": (
        "maxrenyi.json",
        {
            "threats": {
                "server": {HEADLINE: {"intervals": _pooled(0.01)}},
                "client": {"pooled": {HEADLINE: _pooled(0.03), "calibrated-base": _pooled(0.04)}},
            }
        },
        "clients-calibrated-base",
    ),
    "reprogram": (
        "global_attack.json",
        {"attacks": {"global-loss": {"pooled": _pooled(0.02)}, "global-calibrated": {"pooled": _pooled(0.01)}}},
        "global-loss",
    ),
}


@pytest.mark.parametrize("family", sorted(REPORTS))
def test_the_picture_names_the_best_attack_of_each_familys_report(family, tmp_path):
    name, report, best = REPORTS[family]
    assert "membership attack" not in draw_privacy(_data(3, 0.0, family), tmp_path)["privacy.png"]
    (tmp_path / name).write_text(json.dumps(report))
    attacks = FAMILIES[family].reported_attacks(tmp_path)
    assert best_attack(attacks)[0] == best
    assert "membership attack" in draw_privacy(_data(3, 0.0, family), tmp_path)["privacy.png"]


def test_the_best_attack_is_the_highest_tpr_at_the_lowest_fpr():
    assert best_attack({"lira-offline": _pooled(0.02), "rmia-offline": _pooled(0.05)}) == (
        "rmia-offline",
        0.05,
        0.004,
        0.55,
    )
    assert best_attack({}) is None


# a thousand nodes; or ten nodes with more labels than a legend names (40 stacked colours no
# reader could tell apart): both the matrix, whose rows are named
@pytest.mark.parametrize("nodes_n", [1000, 10])
def test_many_nodes_or_labels_are_one_matrix_of_a_fixed_size(nodes_n, tmp_path):
    import numpy as np
    from PIL import Image

    from fedvlm.plots.partition import COUNTS, FILE, draw_partition

    rng = np.random.default_rng(0)
    names = [f"label {k}" for k in range(40)]
    nodes = {
        f"client-{i}": {"partition_id": i, "train": rng.integers(0, 3, 40).tolist(), "test": [1] * 40}
        for i in range(nodes_n)
    }
    (tmp_path / COUNTS).write_text(json.dumps({"names": names, "nodes": nodes}))
    shows = draw_partition({"config": {"method": "promptfl", "dataset": "embedded", "partitioner": "iid"}}, tmp_path)
    assert shows == {FILE: ["training records per label and node (a cell per node and label)"]}
    assert Image.open(tmp_path / FILE).size == (1210, 528)  # 11 x 4.8 inches at 110 dpi, whatever the nodes


def test_the_plots_command_names_a_damaged_record_or_a_folder_it_cannot_write(tmp_path, capsys):
    """A damaged results.json or a read-only folder was a traceback naming no file."""
    import os

    from fedvlm.plots.__main__ import main

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "results.json").write_text("[]")
    assert main([str(damaged)]) == 2
    err = capsys.readouterr().err
    assert str(damaged / "results.json") in err and "not a run's record" in err and "restore it" in err
    assert (damaged / "results.json").read_text() == "[]" and sorted(p.name for p in damaged.iterdir()) == [
        "results.json"
    ]
    if os.geteuid() == 0:
        return  # root writes into a read-only folder: the path cannot be taken here
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "results.json").write_text(
        json.dumps({"run": {"status": "finished"}, "config": {}, "rounds": [], "final": {}})
    )
    locked.chmod(0o500)
    try:
        assert main([str(locked)]) == 2
        assert "cannot write its pictures" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_a_damaged_sweep_summary_is_named_with_the_fix(tmp_path, capsys):
    """summary.csv in binary, without its columns, or with a row longer than its header."""
    from fedvlm.plots.__main__ import main

    for body, words in (
        (b"\xff\xfe\x00", "not UTF-8 text"),
        (b"a,b\n1,2\n", "no column variant, epsilon, seed, status"),
        (b"variant,epsilon,seed,status\np,none,0,finished,extra\n", "line 2 has more cells than columns"),
        (b"variant,epsilon,seed,status,local-acc\np,none,0\n", "line 2 has fewer cells than columns"),
    ):
        (tmp_path / "summary.csv").write_bytes(body)
        assert main([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "summary.csv" in err and words in err and "run the sweep again with the same --out" in err


def test_a_redraw_keeps_a_symlinked_results_json_a_link(tmp_path):
    """The run's record updated where the link points; the link replaced by a file was a change
    to what the user handed the tool."""
    from fedvlm.plots import redraw_run

    kept = tmp_path / "elsewhere.json"
    kept.write_text(json.dumps({"config": {}, "run": {"status": "finished"}, "rounds": []}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").symlink_to(kept)
    redraw_run(tmp_path / "run")
    assert (tmp_path / "run" / "results.json").is_symlink()
    assert "plots" in json.loads(kept.read_text())["run"]


def test_a_curve_leaves_out_a_value_that_is_not_a_number_and_says_which(tmp_path, caplog):
    """A hand-edited or damaged results.json with a string, list or dict where a round figure
    should be: the curves are drawn from the numbers, the others named in a warning (the whole
    picture used to fail with a TypeError)."""
    from fedvlm.plots.curves import draw_curves

    rounds = [
        {"round": i, "metrics": {"train-loss": v}} for i, v in enumerate([2.0, "n/a", [1], {"x": 1}, 1.5, True], 1)
    ]
    data = {"config": {"method": "promptfl", "dataset": "embedded"}, "rounds": rounds}
    with caplog.at_level("WARNING"):
        drawn = draw_curves(data, tmp_path)
    assert drawn == {"loss.png": ["train-loss"]} and (tmp_path / "loss.png").is_file()
    assert "train-loss is not a number in round(s) 2, 3, 4, 6" in caplog.text
