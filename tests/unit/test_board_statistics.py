"""What the published figures are compared with: each attack figure's own chance level (measured
by attacking with scores that ignore membership), the seeds' statistics (ddof 1, Student-t
intervals, paired differences, checked against scipy), and the board's rows (one attack named
for every seed, the cost of privacy against the same method at the same compute)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fedvlm.attacks.likelihood import bootstrap, chance, roc_metrics
from fedvlm.experiments import leaderboard, stats


@pytest.mark.parametrize("n_out", [100, 300, 999, 2000, 5000])
def test_the_chance_level_is_what_blind_scores_get(n_out):
    """Scores independent of membership: their mean TPR at FPR <= 0.1% over many draws is
    (floor(0.001 n) + 1) / (n + 1), which below 1000 non-members is the TPR at zero false
    positives (0.99% at 100), never the nominal 0.1%."""
    rng = np.random.default_rng(n_out)
    member = np.r_[np.ones(200, bool), np.zeros(n_out, bool)]
    draws = [roc_metrics(rng.random(len(member)), member) for _ in range(3000)]
    for metric in ("tpr@0.1%fpr", "tpr@1%fpr", "auc"):
        observed = np.mean([d[metric] for d in draws])
        spread = np.std([d[metric] for d in draws]) / np.sqrt(len(draws))
        assert abs(observed - chance(metric, n_out)) < 4 * spread + 1e-4, (metric, observed, chance(metric, n_out))
    assert chance("tpr@0.1%fpr", 100) == pytest.approx(1 / 101)
    assert chance("tpr@0.1%fpr", 2000) == pytest.approx(3 / 2001)


def test_every_bootstrapped_figure_carries_its_chance_and_its_count():
    member = np.r_[np.ones(50, bool), np.zeros(150, bool)]
    out = bootstrap(np.random.default_rng(0).random(200), member, samples=50)
    assert out["tpr@0.1%fpr"]["chance"] == pytest.approx(1 / 151) and out["auc"]["chance"] == 0.5
    assert {v["non-members"] for v in out.values()} == {150}


def test_a_spread_over_seeds_is_ddof_1_with_a_student_t_interval():
    values = [0.31, 0.35, 0.29, 0.40, 0.33]
    figure = stats.spread(values)
    assert figure is not None and figure.std == pytest.approx(np.std(values, ddof=1))
    low, high = scipy_stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=scipy_stats.sem(values))
    assert (figure.low, figure.high) == pytest.approx((low, high))
    assert stats.spread([0.5]) == stats.Spread(0.5, None, 1, None, None)
    assert stats.spread([None, float("nan")]) is None


def test_a_difference_is_paired_by_seed_else_welch():
    a = {0: 0.50, 1: 0.55, 2: 0.47}
    b = {0: 0.40, 1: 0.47, 2: 0.36}
    paired = stats.difference(a, b)
    test = scipy_stats.ttest_rel(list(a.values()), list(b.values()))
    low, high = test.confidence_interval(0.95)
    assert paired is not None and (paired.mean, paired.low, paired.high) == pytest.approx((0.09666667, low, high))
    welch = stats.difference(a, {3: 0.40, 4: 0.47, 5: 0.36, 6: 0.41})
    test = scipy_stats.ttest_ind(list(a.values()), [0.40, 0.47, 0.36, 0.41], equal_var=False)
    assert welch is not None and (welch.low, welch.high) == pytest.approx(test.confidence_interval(0.95))
    assert paired.excludes(0.0) and not stats.difference({0: 0.5, 1: 0.4}, {0: 0.45, 1: 0.45}).excludes(0.0)


def _row(variant, method, eps, seed, acc, attacks=None, steps=8.0):
    row = {
        "family": "prompt",
        "variant": variant,
        "method": method,
        "epsilon": eps,
        "seed": seed,
        "status": "finished",
        "local-acc-last10-mean": acc,
        "local-steps-per-round": steps,
    }
    for name, tpr in (attacks or {}).items():
        row |= {f"mia-{name}-tpr@0.1%fpr": tpr, f"mia-{name}-tpr@0.1%fpr-chance": 0.0099, f"mia-{name}-auc": 0.5}
    return row


def test_a_board_row_names_one_attack_for_every_seed_and_measures_privacy_at_matched_compute():
    rows = [
        # the best attack differs by seed: the row reports the one best on average, for every seed
        _row("promptfl", "promptfl", "8", 0, 0.30, {"lira": 0.05, "rmia": 0.00}, steps=1),
        _row("promptfl", "promptfl", "8", 1, 0.32, {"lira": 0.00, "rmia": 0.02}, steps=1),
        _row("promptfl", "promptfl", "8", 2, 0.31, {"lira": 0.04, "rmia": 0.03}, steps=1),
        *(_row("promptfl", "promptfl", "none", s, 0.40 + s / 100) for s in range(3)),
        *(_row("promptfl-dpcompute", "promptfl", "none", s, 0.33 + s / 100, steps=1) for s in range(3)),
    ]
    entries = {(e["variant"], e["epsilon"]): e for e in leaderboard.board(rows)}
    private = entries[("promptfl", "8")]
    assert private["attack"] == "lira" and private["attack-tpr@0.1%fpr"] == pytest.approx(0.03)
    assert private["attack-tpr@0.1%fpr-chance"] == pytest.approx(0.0099)
    # its reference is the no-DP run at its own compute (one step), not the 8-step one
    assert private["reference"] == "promptfl-dpcompute"
    delta = private["delta-local-acc"]
    assert delta["mean"] == pytest.approx(-0.03) and delta["n"] == 3
    assert private["local-acc" + leaderboard.STD] == pytest.approx(0.01)  # over seeds, ddof 1
    assert private["local-steps-per-round"] == 1 and entries[("promptfl", "none")]["local-steps-per-round"] == 8
    md = "\n".join(leaderboard.family_tables(list(entries.values())))
    head, _, *body = md.split("\n\n")[0].splitlines()
    cells = [dict(zip(head.split(" | "), line.split(" | "), strict=True)) for line in body]
    steps = {(c["| variant"], c["target eps"]): c["local steps / round"] for c in cells}
    assert steps[("| promptfl", "8")] == "1.0" and steps[("| promptfl", "none")] == "8.0"  # under its own heading
    assert "| promptfl-dpcompute | none |" in md and "promptfl-dpcompute |" in md.split("| promptfl | 8 |")[1]


def test_base_to_novel_trains_on_the_base_half_and_tests_every_client_on_the_novel_half():
    from fedvlm.data.partitioners import make_partitions

    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 9, 900), rng.integers(0, 9, 450)
    for name in ("pathological", "dirichlet", "iid"):
        parts = make_partitions(name, train, test, 9, 3, seed=1, alpha=0.5, class_split="base-to-novel")
        assert {p.base for p in parts} == {5}  # classes 0..4 base (half, rounded up), 5..8 novel
        assert all(train[p.train].max() < 5 and test[p.test].max() < 5 for p in parts)
        novel = np.sort(np.concatenate([p.novel for p in parts]))
        assert np.array_equal(novel, np.flatnonzero(test >= 5))  # every novel test record, once
        assert parts[0].label_space("novel") == slice(5, None) and parts[0].label_space("test") == slice(0, 5)
    plain = make_partitions("iid", train, test, 9, 3, seed=1)
    assert plain[0].novel is None and plain[0].label_space("test") == slice(None)


def test_only_the_prompt_family_takes_base_to_novel():
    from fedvlm.methods.validation import validate
    from fedvlm.runconfig import ConfigError

    assert validate({"method": "promptfl", "class-split": "base-to-novel"}).class_split == "base-to-novel"
    with pytest.raises(ConfigError, match="'class-split' = 'base-to-novel' is not an evaluation the vlm family"):
        validate({"method": "fedrand", "class-split": "base-to-novel"})


def test_epsilon_ticks_that_would_print_over_each_other_share_one_labelled_range():
    """The VLM rows of one target land at 0.69 and 0.94 (and 5.7, 7.7): one tick each pair,
    labelled with its range, between them on the log axis; epsilons far apart keep their own."""
    ticks, labels = leaderboard._epsilon_ticks([0.69, 0.94, 5.7, 7.7])
    assert labels == ["0.69-0.94", "5.7-7.7"]
    assert 0.69 < ticks[0] < 0.94 and 5.7 < ticks[1] < 7.7
    assert leaderboard._epsilon_ticks([1.0, 5.24, 8.0]) == ([1.0, 5.24, 8.0], ["1", "5.24", "8"])
    assert leaderboard._epsilon_ticks([0.998, 1.003])[1] == ["1"]  # the ends print alike: one figure
    assert leaderboard._epsilon_ticks([97.0, 100.0])[1] == ["97-100"]  # not "97-1e+02"


def test_the_named_attack_is_the_one_highest_over_its_own_chance_and_its_auc_has_an_interval():
    """Issue 62's review: FedAvg-LoRA at epsilon 1 named the server attack (TPR 3.00%, chance
    0.99%: 3x) over a client attack nearer its own chance in raw TPR but further above it (2.0%
    against 0.35%: 5.7x). Each AUC over seeds gets its interval, as the TPR does."""
    rows = []
    for seed, auc in enumerate((0.52, 0.55, 0.58)):
        row = _row("fedavg-lora", "fedavg-lora", "1", seed, 0.3, {"server": 0.03, "clients": 0.02})
        row |= {"mia-clients-tpr@0.1%fpr-chance": 0.0035, "mia-clients-auc": auc}
        rows.append(row)
    (entry,) = leaderboard.board(rows)
    assert entry["attack"] == "clients" and entry["attack-tpr@0.1%fpr-chance"] == pytest.approx(0.0035)
    assert entry["attack-auc"] == pytest.approx(0.55)
    low, high = entry["attack-auc-ci95"]
    half = scipy_stats.t.ppf(0.975, 2) * 0.03 / np.sqrt(3)
    assert (low, high) == pytest.approx((0.55 - half, 0.55 + half))
    assert leaderboard.auc_cell(entry) == f"0.550 [{low:.3f}, {high:.3f}]"
    assert leaderboard.auc_cell(entry | {"attack-auc-ci95": [0.51, 0.6]}).endswith(" *")


def test_a_run_records_the_commit_it_was_made_with_and_a_board_counts_them():
    """Issue 62's review: the board's runs span a week of commits and no run said which; a later
    change can move a figure (experiments.md measured up to 1.7 points). Each run now records its
    code, and the board prints how many of its runs each commit made."""
    import subprocess
    from pathlib import Path

    from fedvlm.experiments.sweep import code
    from fedvlm.server_app.results import source

    made = source()
    root = Path(leaderboard.__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    assert made["version"] and made["commit"] == head.stdout.strip() and made["changed"] in (True, False)
    assert code({"run": {"fedvlm": {**made, "changed": True}}}) == head.stdout.strip() + "+changes"
    assert code({"run": {"fedvlm": {"version": "0.1.0", "commit": None}}}) == "fedvlm 0.1.0"
    assert code({"run": {}}).startswith("not recorded")
    rows = [_row("promptfl", "promptfl", "none", s, 0.4) | {"code": c} for s, c in enumerate(("a1", "a1", "b2"))]
    assert leaderboard.provenance(leaderboard.board(rows), "code") == "a1 (2 runs); b2 (1 run)"


def test_the_board_says_which_rows_are_matched_in_compute_by_their_own_steps():
    """Issue 62, item 2: a private row without a ``-dpcompute`` row is matched only where its
    steps per round do not change with the privacy level; the legend says which, from the runs."""
    entries = [
        {"variant": "dpfpl", "local-steps-per-round": 1.0, "epsilon-spent": None},
        {"variant": "dpfpl", "local-steps-per-round": 1.0, "epsilon-spent": 8.0},
        {"variant": "fedrand", "local-steps-per-round": 15.7, "epsilon-spent": None},
        {"variant": "fedrand", "local-steps-per-round": 16.7, "epsilon-spent": 8.0},  # the audited node's canaries
        {"variant": "promptfl", "local-steps-per-round": 8.0, "epsilon-spent": None},
        {"variant": "promptfl", "local-steps-per-round": 1.0, "epsilon-spent": 8.0},
        {"variant": "pfedmoap", "local-steps-per-round": 8.0, "epsilon-spent": None},
        {"variant": "pfedmoap", "local-steps-per-round": 1.0, "epsilon-spent": 8.0},
        {"variant": "pfedmoap" + leaderboard.MATCHED, "local-steps-per-round": 1.0, "epsilon-spent": None},
    ]
    said = leaderboard.same_compute(entries)
    assert said.startswith("dpfpl, fedrand: the same local steps")
    assert "promptfl: no matched row, and steps that differ" in said and "pfedmoap" not in said


def test_a_board_names_rows_whose_seeds_started_from_different_backbone_weights():
    """Issue 62: the embedded default is pretrained on the machine that first needs it, and an
    Intel and an AMD CPU gave two sets of weights (pFedMoAP's seed 0 without noise: 87.50% on
    one, 92.81% on the other). A row mixing them is named, and the board counts each backbone."""
    from fedvlm.experiments import sweep
    from fedvlm.experiments.sweep import backbone

    assert backbone({"run": {"backbone": {"fingerprint": "embedded-tiny:gelu:sha256:ab"}}}).endswith("sha256:ab")
    # a run from before its family recorded them: named by its CPU (which decided the embedded weights)
    assert backbone({"run": {"host": {"cpu": "AMD EPYC"}}}) == "not recorded (run on AMD EPYC)"
    assert backbone({"run": {}}) == sweep.BACKBONE_UNKNOWN
    rows = [_row("promptfl", "promptfl", "none", s, 0.4) | {"backbone": b} for s, b in enumerate(("a", "a", "b"))]
    entries = leaderboard.board(rows)
    assert leaderboard.provenance(entries, "backbones") == "a (2 runs); b (1 run)"
    assert "promptfl at none" in leaderboard.mixed_backbones(entries)
    same = leaderboard.board([_row("promptfl", "promptfl", "none", s, 0.4) | {"backbone": "a"} for s in range(2)])
    assert leaderboard.mixed_backbones(same) == ""
    # a seed that recorded neither its weights nor its CPU is counted, and named mixed with nothing
    unknown = [_row("promptfl", "promptfl", "none", s, 0.4) | {"backbone": b} for s, b in enumerate(("a", "a"))]
    unknown.append(_row("promptfl", "promptfl", "none", 2, 0.4) | {"backbone": sweep.BACKBONE_UNKNOWN})
    assert leaderboard.mixed_backbones(leaderboard.board(unknown)) == ""
