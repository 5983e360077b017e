"""Sweeps, boards and protocols refuse bad arguments before they make or replace anything, and a
damaged run a sweep reuses is a failed row naming its file (found by a second attacker: an empty
board replaced the one in --out, a stale report was rewritten, one damaged record ended a sweep)."""

from __future__ import annotations

import json

import pytest

from fedvlm.experiments import leaderboard, protocols, sweep
from fedvlm.experiments.sweep_report import read_summary


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_a_board_with_no_method_to_run_leaves_the_board_in_out(tmp_path, capsys):
    (tmp_path / "leaderboard.md").write_text("PRECIOUS")
    said = _refused(leaderboard.main, ["--out", str(tmp_path), "--methods", "fedrand", "--families", "prompt"], capsys)
    assert "has no method of --families prompt" in said
    for argv, words in ((["--methods", "nope"], "--methods: "), (["--seeds", "x"], "--seeds: 'x'")):
        assert words in _refused(leaderboard.main, ["--out", str(tmp_path), *argv], capsys)
    assert (tmp_path / "leaderboard.md").read_text() == "PRECIOUS" and not (tmp_path / "leaderboard.json").exists()


def test_a_protocol_refuses_epsilons_it_does_not_run_and_keeps_its_report(tmp_path, capsys):
    (tmp_path / "dirichlet-0.1.md").write_text("PRECIOUS")
    out = ["--out", str(tmp_path), "--quick", "--no-attacks"]
    said = _refused(protocols.main, ["dirichlet-0.1", *out, "--epsilons", "1"], capsys)
    assert "--epsilons: 1 not among none" in said
    assert "--seeds: 'x'" in _refused(protocols.main, ["paper-dpfpl", *out, "--seeds", "x"], capsys)
    assert (tmp_path / "dirichlet-0.1.md").read_text() == "PRECIOUS" and not (tmp_path / "dirichlet-0.1").exists()


def test_a_protocol_publishes_no_page_of_a_part_of_it(tmp_path, capsys):
    """`--variants` with `--docs` rewrote the published page from that part's runs only (FedRand's
    page lost its FedPer and FedPara rows this way); a part runs without --docs."""
    out = ["--out", str(tmp_path), "--quick", "--no-attacks", "--docs"]
    said = _refused(protocols.main, ["paper-fedrand", *out, "--variants", "fedrand,fedavg-lora"], capsys)
    assert "would publish a page of that part only" in said and not (tmp_path / "paper-fedrand").exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--residual", "yes"], "--residual: 'yes' must be on, off or on,off"),
        (["--clients", "-1"], "--clients: -1 must be at least 1"),
        (["--clients", "0"], "--clients: 0 must be at least 1"),
        (["--seeds", "x"], "--seeds: 'x'"),
        (["--ranks", "x"], "--ranks: 'x'"),
        (["--epsilons", "1,abc"], "--epsilons: 'abc' is neither 'none' nor a target epsilon"),
        (["--epsilons", "0"], "--epsilons: '0'"),
        (["--set", "foo"], "--set 'foo': give KEY=VALUE"),
        (["--methods", "nope"], "nope"),
        (["--methods", "coop", "--epsilons", "1"], "nothing to run"),
    ],
)
def test_a_sweep_refuses_its_arguments_before_it_makes_a_folder(tmp_path, capsys, argv, words):
    assert words in _refused(sweep.main, ["--out", str(tmp_path / "sweep"), *argv], capsys)
    assert not (tmp_path / "sweep").exists()


def test_a_damaged_reused_run_is_a_failed_row_naming_its_file(tmp_path, monkeypatch):
    """A finished run's record without its figures ('final') or with a list for 'privacy' ended
    the whole sweep with a KeyError before its summary was written."""
    out = tmp_path / "sweep"
    folder = out / "runs" / sweep.run_name("zeroshot", "none", 0)
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"config": {}, "run": {"status": "finished"}, "rounds": []}))
    monkeypatch.setattr(sweep, "other_run", lambda raw, reused: [])  # take the record as this run's
    assert sweep.main(["--out", str(out), "--methods", "zeroshot", "--epsilons", "none"]) == 1  # nothing finished
    (row,) = read_summary(out / "summary.csv")
    assert row["status"] == "failed" and "results.json" in row["error"] and "KeyError" in row["error"]


def test_a_familys_later_seeds_stay_on_its_board(tmp_path, monkeypatch):
    """A family run again at five seeds, then the whole board at its three, once published the
    family at three seeds again: the board now reads summary.csv as the sweep leaves it (the rows it
    ran, and the folder's earlier ones it did not)."""
    from fedvlm.experiments.sweep_report import summary_rows

    def fake_sweep(argv):  # as a sweep does: its own runs' rows, then the earlier rows it did not run
        out = tmp_path / argv[argv.index("--out") + 1]
        flag = "--methods" if "--methods" in argv else "--variant"
        labels = [argv[i + 1] for i, a in enumerate(argv) if a == flag]
        seeds = argv[argv.index("--seeds") + 1].split(",")
        epsilons = argv[argv.index("--epsilons") + 1].split(",")
        mine = [(v, e, s) for v in labels for e in epsilons for s in seeds]
        kept = [r for r in summary_rows(out / "summary.csv") if (r["variant"], r["epsilon"], r["seed"]) not in mine]
        rows = [f"{v},m,{e},{s},finished" for v, e, s in mine] + [",".join(r.values()) for r in kept]
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.csv").write_text("variant,method,epsilon,seed,status\n" + "\n".join(rows) + "\n")
        return 0

    monkeypatch.setattr(sweep, "main", fake_sweep)
    five = leaderboard.dataclasses.replace(leaderboard.FULL, seeds=(0, 1, 2, 3, 4))
    for scale in (five, leaderboard.FULL):  # the family's later seeds first, then the board
        rows = leaderboard.run_family("prompt", ["promptfl"], scale, tmp_path, quick=False)
    got: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        got.setdefault((r["variant"], r["epsilon"]), []).append(int(r["seed"]))
    assert got == {
        **{("promptfl", e): [0, 1, 2, 3, 4] for e in ("none", "8", "1")},
        ("promptfl-dpcompute", "none"): [0, 1, 2, 3, 4],
    }
