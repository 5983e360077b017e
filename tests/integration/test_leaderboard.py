"""The leaderboard's quick mode: every cell comes from its runs' own folders (results.json, the
ledger, mia.json), and a second call reuses every finished run."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from fedvlm.attacks.reports import read_prompt
from fedvlm.experiments import leaderboard
from fedvlm.plots.__main__ import main as plots_main
from fedvlm.plots.privacy import best_attack


@pytest.mark.slow  # 19 s: a whole quick board; the protocol test stays in CI
def test_the_quick_board_is_made_of_its_runs_and_resumes(tmp_path, cache_dir, pretrained_clip, monkeypatch):
    monkeypatch.setenv("FEDVLM_CACHE", str(cache_dir))
    out = tmp_path / "board"
    argv = ["--quick", "--out", str(out), "--families", "prompt", "--methods", "dpfpl"]
    assert leaderboard.main(argv) == 0
    entries = {e["epsilon"]: e for e in json.loads((out / "leaderboard.json").read_text())["entries"]}
    assert {e["variant"] for e in entries.values()} == {"dpfpl-r8"}
    assert set(entries) == {"none", "1"}
    for eps, entry in entries.items():
        run = out / "prompt" / "runs" / f"dpfpl-r8-eps{eps}-seed0"
        data = json.loads((run / "results.json").read_text())
        nodes = len(data["run"]["nodes"])
        assert nodes == leaderboard.QUICK.clients
        assert entry["local-acc"] == pytest.approx(data["final"]["local-acc-last10-mean"])
        assert entry["neighbor-acc"] == pytest.approx(data["final"]["neighbor-acc-last10-mean"])
        assert entry["mb-train-up-per-client"] == pytest.approx(data["final"]["train_bytes_up"] / nodes / 1e6)
        assert entry["mb-evaluate-down-per-client"] == pytest.approx(data["final"]["evaluate_bytes_down"] / nodes / 1e6)
        assert entry["rounds"] == 2 and entry["local-steps-per-round"] == 1  # DP-FPL's one step, with DP or not
        assert entry["seconds-per-round"] == pytest.approx(float(np.median([r["seconds"] for r in data["rounds"]])))
        assert entry["seconds-total"] == pytest.approx(sum(r["seconds"] for r in data["rounds"]))
        name, tpr, chance, auc = best_attack(read_prompt(run))  # one seed: the named attack is its best
        assert entry["attack"] == name and entry["attack-tpr@0.1%fpr"] == pytest.approx(tpr)
        assert entry["attack-auc"] == pytest.approx(auc)
        assert entry["attack-tpr@0.1%fpr-chance"] == pytest.approx(chance) and chance > 0.001  # few non-members
        if eps == "1":
            # the run's privacy picture, drawn again once the run was attacked, names the best attack
            assert "membership attack" in data["run"]["plots"]["privacy.png"]
            spent = data["privacy"]["rounds"][-1]["epsilon"]
            assert entry["epsilon-spent"] == pytest.approx(spent) and spent <= 1 + 1e-9
            assert entry["audit-lower-bound"] == pytest.approx(data["audit"]["nodes"]["client-0"]["epsilon_lower"])
        else:
            assert entry["epsilon-spent"] is None and entry["audit-lower-bound"] is None
    board = (out / "leaderboard.md").read_text()
    assert "| dpfpl-r8 | 1 |" in board and "| dpfpl-r8 | none |" in board
    # the machine the runs' seconds were measured on, as each run recorded it
    host = json.loads((out / "prompt" / "runs" / "dpfpl-r8-eps1-seed0" / "results.json").read_text())["run"]["host"]
    assert f"recorded it: {host['system']} {host['cpu']}, {host['cores']} CPU cores" in board
    assert "nodes on cpu" in board
    assert (out / "leaderboard_pareto.png").stat().st_size > 10_000

    # the sweep's pictures redraw from its folder alone
    drawn = sorted(png.name for png in (out / "prompt").glob("*.png"))
    assert {"accuracy_vs_epsilon.png", "audit_vs_accounted.png"} <= set(drawn)
    for png in (out / "prompt").glob("*.png"):
        png.unlink()
    assert plots_main([str(out / "prompt")]) == 0
    assert sorted(png.name for png in (out / "prompt").glob("*.png")) == drawn

    written = {p: p.stat().st_mtime_ns for p in (out / "prompt" / "runs").glob("*/*.json")}
    assert leaderboard.main(argv) == 0  # resumed: nothing runs again
    assert {p: p.stat().st_mtime_ns for p in written} == written
    assert json.loads((out / "leaderboard.json").read_text())["entries"] == list(entries.values())

    # what the published board commits (its .gitignore) is all a resumed board needs
    shutil.copy(leaderboard.DOCS / "leaderboard-runs" / ".gitignore", out / ".gitignore")
    git = ["git", "-C", str(out)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    kept = set(subprocess.run([*git, "ls-files"], check=True, capture_output=True, text=True).stdout.split())
    assert {f"prompt/runs/dpfpl-r8-eps{e}-seed0/{f}" for e in entries for f in ("results.json", "mia.json")} <= kept
    shutil.rmtree(out / ".git")
    for f in [f for f in out.rglob("*") if f.is_file() and str(f.relative_to(out)) not in kept]:
        f.unlink()
    assert not [f for f in out.rglob("*") if f.is_file() and "published" in f.parts]  # the prompts are gone
    assert leaderboard.main(argv) == 0  # from the committed files alone: nothing runs or is attacked again
    still = {p: t for p, t in written.items() if str(p.relative_to(out)) in kept}
    assert {p: p.stat().st_mtime_ns for p in still} == still
    assert json.loads((out / "leaderboard.json").read_text())["entries"] == list(entries.values())


def test_the_pareto_front_keeps_the_points_nothing_beats():
    points = [(1.0, 20.0), (2.0, 25.0), (2.0, 22.0), (4.0, 24.0), (8.0, 30.0), (0.5, 10.0)]
    assert leaderboard.pareto_front(points) == [(0.5, 10.0), (1.0, 20.0), (2.0, 25.0), (8.0, 30.0)]


def test_the_pareto_plot_shows_each_row_spread_over_seeds(tmp_path, monkeypatch):
    """A row averaged over seeds is drawn with its std as an error bar; a one-seed row has none."""
    from matplotlib.axes import Axes

    drawn: list[tuple[float, float, float | None]] = []
    errorbar = Axes.errorbar

    def recording(self, x, y, yerr=None, **kw):
        drawn.append((x, y, yerr))
        return errorbar(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(Axes, "errorbar", recording)
    common = {"family": "prompt", "neighbor-acc": 0.2, "attack-tpr@0.1%fpr": 0.002, "attack-tpr@0.1%fpr-chance": 0.01}
    entries = [
        {**common, "method": "dpfpl", "variant": "dpfpl-r8", "epsilon": "8", "target": "8", "seeds": 3}
        | {"local-acc": 0.48, "local-acc" + leaderboard.STD: 0.02, "epsilon-spent": 8.0},
        {**common, "method": "coop", "variant": "coop", "epsilon": "none", "target": "none", "seeds": 1}
        | {"local-acc": 0.85, "local-acc" + leaderboard.STD: None, "epsilon-spent": None},
    ]
    leaderboard.plot_pareto(entries, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000
    # each row on both panels (accounted epsilon, attack TPR), in percent
    assert sorted(drawn, key=lambda d: (d[1], d[0])) == [
        (0.2, 48.0, 2.0),
        (8.0, 48.0, 2.0),
        (0.2, 85.0, None),
        (16.0, 85.0, None),
    ]
