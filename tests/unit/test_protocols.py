"""The seed papers' protocols: every run they plan is a valid run config (checked before hours of
runs, as the sweep checks), and a headline's verdict follows its paired interval."""

from __future__ import annotations

import dataclasses

import pytest

from fedvlm.experiments.protocols import LAST10, PROTOCOLS, Headline, runs_at, scale_of, verdict
from fedvlm.experiments.sweep import without_noise
from fedvlm.methods.validation import validate
from fedvlm.runconfig import parse_value
from fedvlm.spec import spec_of


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_every_run_of_a_protocol_is_a_valid_config_of_its_family(name):
    protocol = PROTOCOLS[name]
    sets = dict(item.split("=", 1) for item in scale_of(protocol, False, (), True).sets)
    labels = [label for label, _, _ in protocol.variants]
    assert len(set(labels)) == len(labels)
    for eps in protocol.epsilons:
        for label, method, overrides in runs_at(protocol, list(protocol.variants), eps):
            raw = {k: parse_value(v) for k, v in sets.items()} | overrides | {"method": method}
            raw = without_noise(raw) if eps == "none" else raw  # as the sweep makes the run
            raw["privacy.epsilon"] = 0.0 if eps == "none" else float(eps)
            cfg = validate(raw)
            assert spec_of(cfg).family.name == protocol.family, (label, eps)
    for h in protocol.headlines:  # every headline compares rows the protocol makes
        for label, eps in h.rows():
            assert label in labels and label in {v[0] for v in runs_at(protocol, list(protocol.variants), eps)}, (
                h,
                label,
                eps,
            )
        assert h.claim, h


def _rows(better: list[float], worse: list[float], figure="local-acc" + LAST10) -> list[dict]:
    rows = [{"variant": "a", "epsilon": "0.1", "seed": s, figure: v} for s, v in enumerate(better)]
    return rows + [{"variant": "b", "epsilon": "0.1", "seed": s, figure: v} for s, v in enumerate(worse)]


def test_privacys_cost_compares_one_method_at_two_levels_paired_by_seed():
    """pFedMoAP's Table 6 claim: its private row within 1% of its own row without noise. Each
    row is read at its own level; a row at a third level is never mixed in."""
    h = Headline("a keeps its accuracy", "local-acc" + LAST10, "a", "a", "25", within=0.01, worse_epsilon="none")
    rows = [
        {"variant": "a", "epsilon": e, "seed": s, "local-acc" + LAST10: v}
        for e, vals in (("none", [0.90, 0.92, 0.91]), ("25", [0.899, 0.921, 0.909]), ("50", [0.1, 0.1, 0.1]))
        for s, v in enumerate(vals)
    ]
    assert h.pair() == "a at epsilon 25 - a at epsilon none"
    assert verdict(h, rows).outcome == "reproduced"
    dropped = [r | {"local-acc" + LAST10: 0.8} if r["epsilon"] == "25" else r for r in rows]
    assert verdict(h, dropped).outcome == "reversed"  # 12% below its own without noise
    assert verdict(h, [r for r in rows if r["epsilon"] != "none"]).outcome == "not measurable"


def test_a_verdict_follows_the_paired_interval():
    h = Headline("a above b", "local-acc" + LAST10, "a", "b", "0.1")
    assert verdict(h, _rows([0.50, 0.52, 0.51], [0.40, 0.41, 0.43])).outcome == "reproduced"
    assert verdict(h, _rows([0.30, 0.31, 0.33], [0.40, 0.41, 0.43])).outcome == "reversed"
    assert verdict(h, _rows([0.40, 0.45, 0.38], [0.41, 0.40, 0.42])).outcome == "not measurable"
    assert verdict(h, _rows([0.5], [0.4])).outcome == "not measurable"  # one seed: no interval
    assert verdict(h, _rows([], [0.4, 0.5])).outcome == "not measurable"  # a row missing
    lower = Headline("a leaks less", "auc", "a", "b", "0.1", higher=False)
    assert verdict(lower, _rows([0.51, 0.50, 0.52], [0.60, 0.62, 0.61], "auc")).outcome == "reproduced"
    close = Headline("a within 1% of b", "cider", "a", "b", "0.1", within=0.01)
    assert verdict(close, _rows([100.2, 99.9, 100.1], [100.0, 100.2, 99.8], "cider")).outcome == "reproduced"
    assert verdict(close, _rows([85.0, 84.0, 86.0], [100.0, 100.2, 99.8], "cider")).outcome == "reversed"


def test_an_attack_at_chance_in_every_run_settles_nothing():
    """Two rows whose attack figures all sit at chance (each run's interval covers it) differ by
    noise: the verdict says there is no leak to compare, even when the paired interval excludes 0."""
    h = Headline("a leaks less", "auc", "a", "b", "0.1", higher=False)
    rows = _rows([0.470, 0.472, 0.471], [0.500, 0.502, 0.501], "auc")
    for r in rows:
        r.update({"auc-lo": r["auc"] - 0.04, "auc-hi": r["auc"] + 0.04, "auc-chance": 0.5})
    judged = verdict(h, rows)
    assert judged.outcome == "not measurable" and "chance level in every run" in judged.why
    rows[3].update({"auc": 0.62, "auc-lo": 0.58, "auc-hi": 0.66})  # b leaks in one run: a real figure to compare
    assert "chance" not in verdict(h, rows).why


def test_a_within_claim_pairs_each_seed_with_its_own_base():
    """A 'within' claim is judged on each seed's ratio to the same seed's base row. Dividing by the
    base row's mean instead dropped that row's spread across seeds from the interval: FedRand's
    5-seed server model read as reversed (-22.7% [-35.0%, -10.3%]) where the paired ratios are not
    measurable."""
    close = Headline("a within 1% of b", "cider", "a", "b", "0.1", within=0.01)
    steady = [100.0, 100.0, 100.0, 100.0]
    wild = [100.0, 160.0, 70.0, 130.0]  # the base row alone swings from seed to seed
    judged = verdict(close, _rows(steady, wild, "cider"))
    assert judged.outcome == "not measurable" and judged.difference is not None
    ratios = [a / b - 1 for a, b in zip(steady, wild, strict=True)]
    assert abs(judged.difference.mean - sum(ratios) / len(ratios)) < 1e-12


@pytest.mark.parametrize("command", ["sweep", "leaderboard", "protocols", "reprogram_sweep"])
def test_every_experiment_command_reads_its_seeds_one_way(command, capsys):
    import importlib

    main = importlib.import_module(f"fedvlm.experiments.{command}").main
    with pytest.raises(SystemExit):
        main(["--seeds", "1,x", *(["paper-dpfpl"] if command == "protocols" else [])])
    assert "argument --seeds: '1,x' is not a comma-separated list of whole numbers" in capsys.readouterr().err


def test_a_page_is_the_whole_protocol_or_its_headline_rows(capsys):
    """--docs refuses an arbitrary part (its page would stand for the whole); --headline-rows picks
    exactly the cells the verdicts read, and the page names every cell it left out."""
    from fedvlm.experiments.protocols import headline_cells, left_out, main

    with pytest.raises(SystemExit):
        main(["paper-dpfpl", "--variants", "fedotp", "--docs"])
    assert "--docs with part of the protocol" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["paper-dpfpl", "--headline-rows", "--epsilons", "0.1"])
    assert "drop --variants and --epsilons" in capsys.readouterr().err
    protocol = PROTOCOLS["paper-dpfpl"]
    cells = headline_cells(protocol)
    assert list(cells) == ["none", "0.1", "0.01"]  # the protocol's order, and only the levels a headline reads
    assert cells["none"] == {"zeroshot"}  # the floor every utility headline is held to
    assert cells["0.1"] == {
        "promptfl",
        "dpfpl-r8",
        "dpfpl-r8-nores",
        "fedpgp",
        "fedotp",
        "promptfl-lr0.01",
        "dpfpl-r8-lr0.01",
        "dpfpl-r1-lr0.01",  # the rank ablation's ends
    }
    assert cells["0.01"] == {"promptfl", "dpfpl-r8", "dpfpl-r8-nores"}  # not every row at every level
    note = left_out(protocol)
    assert "epsilon 0.4 (all)" in note and "zeroshot" not in note.split("Not run")[1]  # it runs without noise only
    ranks = "dpfpl-r8-lr0.01, dpfpl-r4-lr0.01, dpfpl-r2-lr0.01, dpfpl-r1-lr0.01"
    trained = f"promptfl, dpfpl-r8, dpfpl-r8-nores, fedotp, fedpgp, promptfl-lr0.01, {ranks}"
    assert f"{trained} at epsilon none" in note
    assert f"fedotp, fedpgp, promptfl-lr0.01, {ranks} at epsilon 0.01" in note
    assert "dpfpl-r4-lr0.01, dpfpl-r2-lr0.01 at epsilon 0.1" in note  # no headline reads the middle ranks


def test_a_protocols_summary_is_ordered_by_its_variants_levels_and_seeds_whichever_call_ran_last(tmp_path):
    """A protocol's folder fills call by call (FedOTP's seeds 3-4 after everything else); its
    summary.csv reads in the protocol's order of variants, privacy levels and seeds, and keeps every
    row and column the calls wrote."""
    from fedvlm.experiments.protocols import _calls
    from fedvlm.experiments.sweep_report import order_summary, summary_rows

    protocol = PROTOCOLS["paper-dpfpl"]
    path = tmp_path / "summary.csv"
    path.write_text(
        "variant,method,epsilon,seed,status,extra\nfedotp,fedotp,0.1,0,ok,x\nother,m,none,0,ok,\n"
        "promptfl,promptfl,0.1,1,ok,\npromptfl,promptfl,0.1,0,ok,\npromptfl,promptfl,none,0,ok,\n"
    )
    order_summary(path, [label for label, _, _ in protocol.variants], protocol.epsilons)
    rows = [(r["variant"], r["epsilon"], r["seed"], r["extra"]) for r in summary_rows(path)]
    assert rows == [
        ("promptfl", "none", "0", ""),
        ("promptfl", "0.1", "0", ""),
        ("promptfl", "0.1", "1", ""),
        ("fedotp", "0.1", "0", "x"),
        ("other", "none", "0", ""),
    ]
    assert _calls({"0.1": ["a", "b"], "0.4": ["a", "b"], "0.01": ["a"]}) == [
        (("0.1", "0.4"), ["a", "b"]),
        (("0.01",), ["a"]),
    ]


def test_every_call_of_a_headline_page_keeps_the_rows_of_the_calls_before_it(tmp_path, monkeypatch):
    """A page's cells run as one sweep per set of variants: the first call's rows (FedOTP's seed 0,
    reused there) once vanished when the second call's were merged with the rows from before the
    first. Each call now leaves summary.csv as its sweep wrote it (the sweep keeps the rows it did
    not run), only reordered."""
    from fedvlm.experiments import protocols, sweep
    from fedvlm.experiments.protocols import headline_cells
    from fedvlm.experiments.sweep_report import summary_rows

    def fake_sweep(argv):  # as a sweep does: its own runs' rows, and the folder's earlier rows it did not run
        epsilons = argv[argv.index("--epsilons") + 1].split(",")
        labels = [argv[i + 1] for i, a in enumerate(argv) if a == "--variant"]
        mine = {(v, e) for v in labels for e in epsilons}
        kept = [r for r in summary_rows(tmp_path / "summary.csv") if (r["variant"], r["epsilon"]) not in mine]
        rows = [f"{v},m,{e},0,finished" for v, e in sorted(mine)] + [",".join(r.values()) for r in kept]
        (tmp_path / "summary.csv").write_text("variant,method,epsilon,seed,status\n" + "\n".join(rows) + "\n")
        return 0

    monkeypatch.setattr(sweep, "main", fake_sweep)
    (tmp_path / "summary.csv").write_text("variant,method,epsilon,seed,status\npromptfl,m,none,0,finished\n")
    protocol = PROTOCOLS["paper-dpfpl"]
    cells = {e: [v for v in protocol.variants if v[0] in labels] for e, labels in headline_cells(protocol).items()}
    protocols._run(protocol, cells, protocols.scale_of(protocol, True, (0,), False), tmp_path)
    got = {(r["variant"], r["epsilon"]) for r in summary_rows(tmp_path / "summary.csv")}
    assert got == {("promptfl", "none")} | {(v[0], e) for e, variants in cells.items() for v in variants}


def test_a_utility_neither_row_lifts_above_what_trains_nothing_settles_nothing():
    """Issue 62's review: DP-FPL's page called 'the residual term helps' reproduced between two rows
    that both scored below zero-shot: the residual hurt less, nothing was learned. A utility
    headline whose rows both sit at or below the protocol's floor is not measurable; one row above
    it is judged by its interval as before, and an attack or a within-share headline ignores it."""
    h = Headline("a above b", "local-acc" + LAST10, "a", "b", "0.1")
    rows = _rows([0.235, 0.236, 0.234], [0.214, 0.215, 0.213])
    floor = [{"variant": "z", "epsilon": "none", "seed": s, "local-acc" + LAST10: 0.241} for s in range(3)]
    assert verdict(h, rows).outcome == "reproduced"
    judged = verdict(h, rows + floor, "z")
    assert judged.outcome == "not measurable" and "trains nothing" in judged.why
    assert judged.difference is not None and judged.difference.low > 0  # the interval is still shown
    lifted = _rows([0.30, 0.31, 0.29], [0.214, 0.215, 0.213])
    assert verdict(h, lifted + floor, "z").outcome == "reproduced"
    assert verdict(h, rows, "z").outcome == "reproduced"  # no floor row run: judged as before
    lower = Headline("a leaks less", "local-acc" + LAST10, "a", "b", "0.1", higher=False)
    assert verdict(lower, _rows([0.21, 0.21, 0.20], [0.235, 0.236, 0.234]) + floor, "z").outcome == "reproduced"


def test_a_protocols_targets_run_only_its_private_rows_and_only_where_accounting_exists():
    """pFedMoAP's Table 6 has PromptFL, PromptFL+FedProx and pFedMoAP under DP; FedOTP's
    node-stepped global prompt (fedotp-fedavg) has no accounting and is never run private."""
    moap = PROTOCOLS["paper-pfedmoap"]
    private = [v[0] for v in runs_at(moap, list(moap.variants), "25")]
    assert private == ["promptfl", "promptfl+fedprox", "pfedmoap", "pfedmoap-upload"]
    assert len(runs_at(moap, list(moap.variants), "none")) == len(moap.variants)
    every = dataclasses.replace(moap, private=())  # no list: every variant its validation accepts there
    ran = [v[0] for v in runs_at(every, list(moap.variants), "25")]
    assert "fedotp-server-lr0.1" in ran and "fedotp-fedavg" not in ran and "zeroshot" not in ran
    for protocol in PROTOCOLS.values():  # a name in `private` is a variant every target runs
        labels = [v[0] for v in protocol.variants]
        for eps in (e for e in protocol.epsilons if e != "none"):
            ran = [v[0] for v in runs_at(protocol, list(protocol.variants), eps)]
            assert set(protocol.private) <= set(labels) and set(protocol.private) <= set(ran), (protocol.name, eps)


def test_a_part_of_a_protocol_never_hands_the_sweep_a_level_without_variants():
    """`--variants fedotp-server-lr0.1` names a variant without DP: its privacy levels have no
    row to run, and a sweep given no variant would run every DP method of the family there."""
    from fedvlm.experiments.protocols import _parser, _selection

    p = _parser()
    args = p.parse_args(["paper-pfedmoap", "--variants", "fedotp-server-lr0.1,coop"])
    assert {e: [v[0] for v in vs] for e, vs in _selection(p, args, PROTOCOLS["paper-pfedmoap"]).items()} == {
        "none": ["coop", "fedotp-server-lr0.1"]
    }


def test_a_protocol_runs_unchanged_with_the_users_overrides_and_refuses_a_mistyped_one(tmp_path, monkeypatch):
    """Issue 62's review: a protocol could not be pointed at real weights and data (no --set). Its
    overrides reach every sweep after the protocol's own sets; a mistyped one stops the call
    with its name, where it once left every private row out without a word."""
    from fedvlm.experiments import protocols, sweep

    calls = []
    monkeypatch.setattr(sweep, "main", lambda argv: calls.append(argv) or 0)
    args = ["paper-pfedmoap", "--out", str(tmp_path), "--no-attacks", "--seeds", "0", "--epsilons", "25"]
    with pytest.raises(SystemExit):  # the fake sweep ran nothing: no rows to report
        protocols.main([*args, "--set", "prompt.lr=0.004"])
    (argv,) = calls
    sets = argv[argv.index("--set") + 1 :]
    assert sets[-1] == "prompt.lr=0.004" and sets[:-1] == list(PROTOCOLS["paper-pfedmoap"].sets)
    assert {argv[i + 1] for i, a in enumerate(argv) if a == "--variant"} == set(PROTOCOLS["paper-pfedmoap"].private)
    with pytest.raises(SystemExit):
        protocols.main([*args, "--set", "prompt.lrr=0.004"])
    assert len(calls) == 1
