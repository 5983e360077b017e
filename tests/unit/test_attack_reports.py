"""A run's attack report is reused only where it was made with the knobs asked for: a board
must not publish a quick board's one-shadow attack as its own."""

from __future__ import annotations

import json

import pytest

from fedvlm.attacks import run as attacks_run


def test_an_attack_report_made_with_other_knobs_is_made_again(tmp_path, monkeypatch):
    def report(federations: int, online: int) -> dict:
        pooled = {"auc": {"value": 0.5}}
        return {
            "shadows": {"federations": federations},
            "online_references": online,
            "summary": {"lira": {"pooled": pooled}},
        }

    made = []

    def run_attacks(run_dir, shadows, online):
        made.append((shadows, online))
        return report(shadows, online)

    monkeypatch.setattr(attacks_run, "run_attacks", run_attacks)
    (tmp_path / "mia.json").write_text(json.dumps(report(1, 0)))  # a quick board's: one shadow federation
    assert attacks_run.pooled_attacks(tmp_path, shadows=1, online=0) == {"lira": {"auc": {"value": 0.5}}}
    assert made == []  # the same knobs: the report is reused
    attacks_run.pooled_attacks(tmp_path, shadows=2, online=0)
    attacks_run.pooled_attacks(tmp_path, shadows=1, online=4)
    assert made == [(2, 0), (1, 4)]


def test_the_federations_an_attack_trains_are_new_runs_even_for_a_resumed_target(tmp_path):
    """A resumed target's config names the folder it continued; a shadow or reference federation
    that inherited it failed to start, and a resumed board row had no attack at all."""
    from fedvlm.methods.validation import validate

    target = validate({"method": "promptfl", "resume": str(tmp_path / "runs" / "target")}).as_dict()
    for cfg in (
        attacks_run.shadow_config(target, 0, tmp_path / "shadows", None),
        attacks_run.reference_config(target, 0, tmp_path / "references", 7),
    ):
        assert cfg["resume"] == "" and validate(cfg).resume == ""


@pytest.mark.parametrize("command", ["fedvlm.attacks.run", "fedvlm.attacks.maxrenyi", "fedvlm.attacks.global_model"])
def test_an_attack_command_names_a_run_folder_it_cannot_read(tmp_path, capsys, command):
    """A folder without results.json, or one whose record names no method, was a traceback."""
    import importlib

    main = importlib.import_module(command).main
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path)])
    assert stop.value.code == 2 and "results.json cannot be read" in capsys.readouterr().err
    if command == "fedvlm.attacks.run":
        (tmp_path / "results.json").write_text('{"run": {}, "config": {}, "rounds": []}')
        for argv, words in (([], "run.method = None"), (["--shadows", "0"], "--shadows and --samples must be")):
            with pytest.raises(SystemExit):
                main([str(tmp_path), *argv])
            assert words in capsys.readouterr().err
