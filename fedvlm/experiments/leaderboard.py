"""One table of every method's utility, privacy and cost on the embedded default.

    python -m fedvlm.experiments.leaderboard                       # the board (--out ~/fedvlm-leaderboard)
    python -m fedvlm.experiments.leaderboard --quick               # a CI-sized check (--out ~/fedvlm-leaderboard-quick)
    python -m fedvlm.experiments.leaderboard --docs                # also into docs/results/leaderboard.md
    python -m fedvlm.experiments.leaderboard --families prompt --methods promptfl,dpfpl --seeds 0

Each family's methods run on its embedded default through the sweep (``experiments.sweep``: the
same runs, one-run audits and membership attacks a sweep makes, in ``--out/<family>/``), at each
privacy level a method has (a method without a mechanism at 'none' only) and each seed; finished
runs are reused, so an interrupted board resumes. Then, per method and privacy level (mean ±
std over seeds for utility, the mean for the rest):

- utility: the family's headline figures, mean of the last 10 rounds (local and neighbour
  accuracy; the VLM methods' CIDEr);
- privacy: the target epsilon, the epsilon the ledger accounted (one accountant for every run:
  ``privacy.accountant``, RDP by default), the one-run audit's lower bound (``privacy.audit-canaries``
  canaries on one node), and the best membership attack's TPR at 0.1% FPR and AUC (the attack with
  the highest TPR, named);
- cost: megabytes each client sent and received, seconds per round (each run's median), on the
  machine named in the table's header.

Writes ``leaderboard.md``, ``.csv``, ``.json`` and ``leaderboard_pareto.png`` (utility against
accounted epsilon and against the best attack's TPR, a bar for the spread over seeds, the
non-dominated points joined) in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvlm.experiments import stats, sweep
from fedvlm.experiments.attack_report import ENDS
from fedvlm.experiments.sweep import MB, whole_numbers
from fedvlm.experiments.sweep_report import LAST10, SPENT, order_summary, read_summary, utility_columns
from fedvlm.methods.registry import FAMILIES, get_method, methods_of
from fedvlm.metrics import AUDIT_METRICS, METRICS, per_client
from fedvlm.strategies.records import TRAFFIC_KEYS
from fedvlm.utils.files import (
    UnreadableFile,
    atomic_copy,
    atomic_savefig,
    atomic_write_json,
    atomic_write_records,
    atomic_write_text,
    read_results,
)
from fedvlm.utils.progress import time_left

log = logging.getLogger("leaderboard")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "results"
# a utility column's spread over seeds and 95% interval on its mean, in the board's rows and its
# JSON: "<column>-seeds-std", "<column>-ci95"; a private row's difference from its reference: "delta-<column>"
STD, CI, DELTA, CHANCE = "-seeds-std", "-ci95", "delta-", "-chance"
TPR, AUC = "tpr@0.1%fpr", "auc"
ATTACK_TPR, ATTACK_AUC = "attack-" + TPR, "attack-" + AUC
COMPUTE = ("rounds", "clients-per-round", "local-steps-per-round", "local-steps-per-client")
COMPUTE_HEADS = ("rounds", "clients / round", "local steps / round", "local steps / client")
# the no-DP run of a method at its DP compute (``MethodSpec.dp_defaults``): "<variant>-dpcompute"
MATCHED, MATCHED_DIR = "-dpcompute", "dp-compute"
STEM, TITLE = "leaderboard", "Leaderboard: utility, privacy and cost of every method on the embedded default"


@dataclass(frozen=True)
class Scale:
    """How big the board is: what every family's runs get."""

    epsilons: tuple[str, ...]
    seeds: tuple[int, ...]
    clients: int
    audit: int  # canaries of the one-run audit
    shadows: int  # shadow federations of the membership attacks (0: no attacks)
    sets: tuple[str, ...]  # run-config overrides for every run


FULL = Scale(("none", "8", "1"), (0, 1, 2), 10, 100, 2, ())
QUICK = Scale(("none", "1"), (0,), 3, 20, 1, ("num-server-rounds=2", "max-per-class=6", "vlm.eval-samples=3"))
# the reprogramming family's quick check: the digits task on its 93 k-weight source (the motif
# source of its embedded default needs minutes of pretraining first)
QUICK_FAMILY = {"reprogram": ("dataset=digits", "reprogram.local-iterations=2")}


def sweep_argv(folder: Path, methods: list[str], scale: Scale, epsilons: tuple[str, ...]) -> list[str]:
    return [
        "--out",
        str(folder),
        *(["--methods", ",".join(methods)] if methods else []),
        "--epsilons",
        ",".join(epsilons),
        "--seeds",
        ",".join(map(str, scale.seeds)),
        "--clients",
        str(scale.clients),
        *(["--mia", "--shadows", str(scale.shadows)] if scale.shadows else []),  # 0: no attacks
        "--audit",
        str(scale.audit),
    ]


def matched(methods: list[str]) -> list[tuple[str, str, dict]]:
    """(label, method, overrides) of the no-DP runs at the compute a method trains with under DP,
    for each method whose DP runs change it (``MethodSpec.dp_defaults``: PromptFL's and pFedMoAP's
    one local step): the private row's cost of privacy is then the noise's alone."""
    return [
        (label + MATCHED, method, {**extra, **get_method(method).dp_defaults})
        for label, method, extra in sweep.method_variants(methods, [int(sweep.RANK)], [True])
        if get_method(method).dp_defaults and get_method(method).supports_dp
    ]


def run_family(family: str, methods: list[str], scale: Scale, out: Path, quick: bool) -> list[dict]:
    """Every run of ``methods`` through the sweep (resumed where it stopped), and their no-DP
    runs at DP compute (in ``<family>/dp-compute``); the summaries' rows, with those of the
    folder's earlier calls (more seeds for a family, ``--seeds``) that this one did not plan."""
    folder = out / family
    sets = [*scale.sets, *(QUICK_FAMILY.get(family, ()) if quick else ())]
    tail = ["--set", *sets] if sets else []
    calls = [(folder, [*sweep_argv(folder, methods, scale, scale.epsilons), *tail])]
    extra = matched(methods) if any(e != "none" for e in scale.epsilons) else []
    if extra:
        variants = [arg for label, method, o in extra for arg in ("--variant", label, method, *pairs(o))]
        matched_folder = folder / MATCHED_DIR
        calls.append((matched_folder, [*sweep_argv(matched_folder, [], scale, ("none",)), *variants, *tail]))
    rows = []
    for where, argv in calls:
        sweep.main(argv)
        order_summary(where / "summary.csv", [], scale.epsilons)
        rows += read_summary(where / "summary.csv")
    return [{**r, "family": family} for r in rows]


def pairs(overrides: dict) -> list[str]:
    return [f"{k}={v}" for k, v in overrides.items()]


def planned(methods: list[str], scale: Scale) -> dict[str, set[str]]:
    """The run folders a family's board makes, by the sweep folder they live in: each method (at
    the sweep's default rank) at each privacy level it has, at each seed; and its no-DP runs at DP
    compute."""
    main = {
        sweep.run_name(label, eps, seed)
        for label, method, _ in sweep.method_variants(methods, [int(sweep.RANK)], [True])
        for eps in scale.epsilons
        if eps == "none" or get_method(method).supports_dp
        for seed in scale.seeds
    }
    extra = matched(methods) if any(e != "none" for e in scale.epsilons) else []
    return {
        "": main,
        MATCHED_DIR: {sweep.run_name(label, "none", seed) for label, _, _ in extra for seed in scale.seeds},
    }


def unfinished(folder: Path, names: dict[str, set[str]]) -> int:
    """How many of ``names`` a family's board still has to make."""
    return sum(len(wanted - finished(folder / sub, wanted)) for sub, wanted in names.items())


def finished(folder: Path, names: set[str]) -> set[str]:
    """Those of ``names`` a sweep folder holds finished (which its sweep reuses)."""
    found = set()
    for name in names:
        with contextlib.suppress(UnreadableFile):  # a damaged one: its sweep says so in its row
            if read_results(folder / "runs" / name, sweep.DAMAGED)["run"].get("status") in sweep.REUSED:
                found.add(name)
    return found


def attack_names(row: dict) -> list[str]:
    """The attacks a sweep row carries a TPR at 0.1% FPR for."""
    return [k[len("mia-") : -len(f"-{TPR}")] for k in row if k.startswith("mia-") and k.endswith(f"-{TPR}")]


def named_attack(runs: list[dict]) -> str | None:
    """The one attack a row reports: of those every seed ran, the one whose TPR at 0.1% FPR stands
    highest over its own chance level, on average over the seeds (attacks on the server model and on
    the clients face different numbers of non-members, so a raw TPR favours the one with more
    chance). One name for every seed, so that the figure is one attack's, not the best of each
    seed's under one name."""
    common = set.intersection(*(set(n for n in attack_names(r) if r[f"mia-{n}-{TPR}"] is not None) for r in runs))
    if not common:
        return None

    def lift(name: str) -> float:
        tpr = float(np.mean([r[f"mia-{name}-{TPR}"] for r in runs]))
        chance = _mean(r.get(f"mia-{name}-{TPR}{ENDS['chance']}") for r in runs)
        return tpr / chance if chance else tpr

    return max(sorted(common), key=lift)


def _mean(values) -> float | None:
    vals = stats.finite(values)
    return float(np.mean(vals)) if vals else None


def _by_seed(runs: list[dict], key: str) -> dict[int, float | None]:
    return {int(r["seed"]): r.get(key) for r in runs}


def group(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """A family's finished runs by (family, variant, epsilon): one board row each."""
    out: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if r["status"] != "failed":
            out.setdefault((r["family"], r["variant"], r["epsilon"]), []).append(r)
    return out


def reference(groups: dict, family: str, variant: str, method: str, eps: str) -> tuple[str, list[dict]] | None:
    """What a private row's cost of privacy is measured against: the same method without noise
    at the private row's compute where the board ran it (``MATCHED``), else its own no-DP row."""
    if eps == "none":
        return None
    for label in (variant + MATCHED, variant):
        runs = groups.get((family, label, "none"))
        if runs and runs[0]["method"] == method:
            return label, runs
    return None


def board(rows: list[dict]) -> list[dict]:
    """One entry per family, variant and target epsilon: the seeds' runs combined
    (``experiments.stats``: mean, ddof-1 std and 95% interval over seeds)."""
    out = []
    groups = group(rows)
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family and r["status"] != "failed"]
        utility = utility_columns(mine)
        for (fam, variant, eps), runs in groups.items():
            if fam != family:
                continue
            out.append(entry(runs, utility, reference(groups, family, variant, runs[0]["method"], eps)))
    for r in (r for r in rows if r["status"] == "failed"):
        out.append(
            {
                "family": r["family"],
                "variant": r["variant"],
                "method": r["method"],
                "epsilon": r["epsilon"],
                "failed": r.get("error", ""),
            }
        )
    return out


def entry(runs: list[dict], utility: list[str], ref: tuple[str, list[dict]] | None) -> dict:
    """A board row from its seeds' sweep rows."""
    first = runs[0]
    z, eps = first.get("noise-multiplier"), first["epsilon"]
    # 'none' asks for no epsilon target; a family with fixed noise (Reprogrammable-FL's z = 1.1) still adds it
    target = f"none (z={z:g})" if eps == "none" and z else eps
    e: dict = {
        "family": first["family"],
        "variant": first["variant"],
        "method": first["method"],
        "epsilon": eps,
        "target": target,
        "seeds": len(runs),
        "seed-list": sorted(int(r["seed"]) for r in runs),
    }
    for key in COMPUTE:
        e[key] = _mean(r.get(key) for r in runs)
    for name in utility:
        figure = stats.spread(r.get(name + LAST10) for r in runs)
        e[name] = figure.mean if figure else None
        e[name + STD] = figure.std if figure else None
        e[name + CI] = [figure.low, figure.high] if figure else None
        for spread in per_client(name).values():  # over the nodes: the worst node's, their std
            e[spread] = _mean(r.get(spread + LAST10) for r in runs)
    if ref is not None and utility:
        label, base = ref
        e["reference"] = label
        for name in utility:
            delta = stats.difference(_by_seed(runs, name + LAST10), _by_seed(base, name + LAST10))
            if delta is not None:
                e[DELTA + name] = delta.as_dict()
    e[SPENT] = _mean(r.get(SPENT) for r in runs)
    e["audit-lower-bound"] = _mean(r.get(AUDIT_METRICS["epsilon-lower"]) for r in runs)
    notes = [r["mia-error"] for r in runs if r.get("mia-error")]
    if notes:  # why the attack columns are empty (or rest on fewer seeds)
        e["attack-note"] = notes[0]
    attack = named_attack(runs)
    if attack is not None:
        tpr = stats.spread(r[f"mia-{attack}-{TPR}"] for r in runs)
        e["attack"] = attack
        e[ATTACK_TPR] = tpr.mean if tpr else None
        e[ATTACK_TPR + CI] = [tpr.low, tpr.high] if tpr else None
        e[ATTACK_TPR + CHANCE] = _mean(r.get(f"mia-{attack}-{TPR}{ENDS['chance']}") for r in runs)
        auc = stats.spread(r.get(f"mia-{attack}-{AUC}") for r in runs)
        e[ATTACK_AUC] = auc.mean if auc else None
        e[ATTACK_AUC + CI] = [auc.low, auc.high] if auc else None
    for key in (*MB.values(), "seconds-per-round"):
        e[key] = _mean(r.get(key) for r in runs)
    e["seconds-total"] = sum(r.get("seconds-total") or 0.0 for r in runs)
    e["machines"] = dict(Counter(str(r.get("machine") or "not recorded") for r in runs))
    e["code"] = dict(Counter(str(r.get("code") or sweep.CODE_NOT_RECORDED) for r in runs))
    e["backbones"] = dict(Counter(str(r.get("backbone") or "not recorded") for r in runs))
    accounted = {(r["accountant"], r["delta"]) for r in runs if r.get("accountant")}
    e["accounting"] = [{"accountant": a, "delta": d} for a, d in sorted(accounted)]
    return e


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def accounting(entries: list[dict]) -> str:
    """The accountants and deltas the board's accounted epsilons are under (one, unless a run was
    made with another ``privacy.accountant`` or ``privacy.delta``)."""
    pairs = dict.fromkeys((a["accountant"], a["delta"]) for e in entries for a in e.get("accounting") or [])
    return " and ".join(f"{a.upper()} at delta {d:g}" for a, d in pairs) or "no accountant (no private run)"


def provenance(entries: list[dict], key: str) -> str:
    """Where (``machines``: each run's host and its nodes' devices), with which code (``code``:
    ``sweep.code``) or from which weights (``backbones``: ``sweep.backbone``) the runs were made,
    and how many runs each: a board whose runs span several says so, since each may move a figure."""
    count: Counter[str] = Counter()
    for e in entries:
        count.update(e.get(key) or {})
    return "; ".join(f"{c} ({n} run{'s' if n > 1 else ''})" for c, n in count.most_common())


FEW_SEEDS = 5  # a difference within two std over fewer seeds than this asks for more


def delta_cell(e: dict, u: str) -> str:
    """A private row's difference from its reference in utility ``u``: mean [95% interval], with
    '†' where it lies within two std over fewer than FEW_SEEDS seeds."""
    d = e.get(DELTA + u)
    if d is None:
        return "-"
    figure = stats.Spread(d["mean"], d["std"], d["n"], *d["ci95"])
    scale = METRICS[u].kind.scale
    close = figure.std is not None and abs(figure.mean) < 2 * figure.std and figure.n < FEW_SEEDS
    return figure.interval(scale) + (" †" if close else "")


def per_client_cell(e: dict, u: str) -> str:
    """How ``u`` spread over the row's nodes: the worst node's and the std over nodes (means of
    the last 10 rounds, averaged over seeds)."""
    names, scale = per_client(u), METRICS[u].kind.scale
    return " / ".join(_fmt(e.get(names[k]), scale) for k in ("min", "std") if k in names)


def attack_cell(e: dict) -> str:
    """The named attack's TPR at FPR <= 0.1% (%): mean over seeds [95% interval, its low end at
    least 0: a rate is not negative, a t interval over few seeds of few hits may be], '*' where the
    whole interval lies above its chance level."""
    if e.get(ATTACK_TPR) is None:
        return "-"
    low, high = e.get(ATTACK_TPR + CI) or (None, None)
    text = f"{100 * e[ATTACK_TPR]:.2f}"
    if low is None or high is None:
        return text
    return text + f" [{100 * max(low, 0.0):.2f}, {100 * high:.2f}]" + (" *" if low > e[ATTACK_TPR + CHANCE] else "")


def auc_cell(e: dict) -> str:
    """The named attack's AUC: mean over seeds [95% interval], '*' where the whole interval lies
    above its chance level, 0.5."""
    if e.get(ATTACK_AUC) is None:
        return "-"
    low, high = e.get(ATTACK_AUC + CI) or (None, None)
    text = f"{e[ATTACK_AUC]:.3f}"
    return text if low is None or high is None else text + f" [{low:.3f}, {high:.3f}]" + (" *" if low > 0.5 else "")


def family_tables(mine: list[dict]) -> list[str]:
    """A family's two tables: utility at its compute, and privacy and cost."""
    utility = utility_columns([{k + LAST10: v for k, v in e.items()} for e in mine])
    units = {u: f" ({METRICS[u].kind.unit})" if METRICS[u].kind.unit else "" for u in utility}
    head = [
        "variant",
        "target eps",
        "seeds",
        *COMPUTE_HEADS,
    ]
    spread = [u for u in utility if per_client(u)]
    head += [f"{u}{units[u]}" for u in utility] + [f"{u} per client: worst / std" for u in spread]
    head += [f"Δ {u} vs reference" for u in utility] + ["reference"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in mine:
        cells = [e["variant"], e["target"], str(e["seeds"])]
        cells += [_fmt(e.get(k), digits=0 if k == "rounds" else 1) for k in COMPUTE]
        cells += [
            _fmt(e.get(u), METRICS[u].kind.scale)
            + ("" if e.get(u + STD) is None else f" ± {_fmt(e[u + STD], METRICS[u].kind.scale)}")
            for u in utility
        ]
        cells += [per_client_cell(e, u) for u in spread]
        cells += [delta_cell(e, u) for u in utility] + [e.get("reference", "-")]
        lines.append("| " + " | ".join(cells) + " |")
    tpr = "TPR at FPR <= 0.1%: 0 FP below 1000 non-members (%)"
    head = ["variant", "target eps", "eps spent", "audit lower bound", "attack", tpr]
    head += ["its chance (%)", "AUC", "MB train up", "MB train down", "MB eval up", "MB eval down", "s/round"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in mine:
        cells = [e["variant"], e["target"], _fmt(e.get(SPENT), digits=3)]
        cells += [_fmt(e.get("audit-lower-bound"), digits=3), e.get("attack", "-"), attack_cell(e)]
        cells += [_fmt(e.get(ATTACK_TPR + CHANCE), 100.0), auc_cell(e)]
        cells += [_fmt(e.get(MB[k]), digits=3) for k in TRAFFIC_KEYS] + [_fmt(e.get("seconds-per-round"), digits=1)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mixed_backbones(entries: list[dict]) -> str:
    """A warning naming the rows whose runs started from different weights (``sweep.backbone``:
    the embedded default pretrained on another CPU): their seeds, and a difference paired by seed
    with a row on other weights, mix the weights with the method. A run that recorded neither its
    weights nor its CPU differs from none: the tally counts it, the warning names what is known."""
    known = [{b for b in e.get("backbones") or {} if b != sweep.BACKBONE_UNKNOWN} for e in entries]
    mixed = [f"{e['variant']} at {e['target']}" for e, made in zip(entries, known, strict=True) if len(made) > 1]
    if not mixed:
        return ""
    return (
        f" **Rows whose runs started from different backbone weights: {', '.join(mixed)}.** Their spread and "
        "any difference paired with them mix the weights with the method: compare seeds made on one backbone."
    )


CANARY_STEPS = 1.1  # an epoch-trained method's audited node adds its canaries' steps under DP: a few %, not 10


def same_compute(entries: list[dict]) -> str:
    """The variants with private rows and no ``MATCHED`` row whose local steps per round are the
    same at every privacy level, as their runs recorded them (up to the audited node's canaries,
    ``CANARY_STEPS``): their own no-noise row is already their matched reference. A variant whose
    steps differ and that has no matched row is named too: its differences mix noise and compute."""
    steps: dict[str, list[float]] = {}
    for e in entries:
        steps.setdefault(e["variant"], []).append(e.get("local-steps-per-round") or 0.0)
    private = {e["variant"] for e in entries if e.get(SPENT)}
    alone = sorted(v for v in private if v + MATCHED not in steps and not v.endswith(MATCHED))
    same = [v for v in alone if 0 < min(steps[v]) and max(steps[v]) <= CANARY_STEPS * min(steps[v])]
    differ = [v for v in alone if v not in same]
    text = (
        f"{', '.join(same)}: the same local steps a round at every privacy level, so each one's row without noise "
        "is its matched reference. "
        if same
        else ""
    )
    return text + (f"{', '.join(differ)}: no matched row, and steps that differ by privacy level. " if differ else "")


def legend(entries: list[dict]) -> list[str]:
    """What each column of a board's tables means: its compute, utility, privacy and cost."""
    return [
        "Compute, as the runs recorded it: rounds, the local steps a trained node ran per round, the local steps "
        f"each node ran over the run, and the nodes trained per round. A `{MATCHED}` row is the method without "
        "noise at the compute its private rows train with (PromptFL's and pFedMoAP's one local step under DP), "
        "and it is the private rows' reference where it exists, so that their difference is the noise's alone. "
        f"{same_compute(entries)}"
        "A private run's audited node trains on its records and the audit's canaries "
        "(`privacy.audit-canaries`), so where a method trains in epochs its steps are a little above the same "
        "method's without noise.",
        "",
        "Utility: mean of the last 10 rounds, averaged over the row's seeds, ± their sample standard deviation "
        "(ddof 1); per client: each round's worst node's figure and the standard deviation over that round's "
        "nodes (ddof 0: every node of the federation, not a sample of them), each the mean of the last 10 rounds, "
        "averaged over seeds. Δ: the private row minus its reference (the same method without a privacy target: "
        "without noise, or, where the family's own setup fixes its noise, as Reprogrammable-FL's z = 1.1, that "
        "row, itself private: the difference is then the target's noise beyond it), paired by seed, with the 95% "
        "Student-t interval of the per-seed differences; † marks a difference within two standard "
        f"deviations measured on fewer than {FEW_SEEDS} seeds.",
        "",
        "Privacy: the target epsilon, the epsilon the run's ledger spent per record (eps spent: every mechanism "
        "composed; "
        f"the most any client spent, under {accounting(entries)}), the one-run audit's lower bound (one node, its "
        "local mechanism), and one membership attack per row, named: of the attacks every seed ran, the one with "
        "the highest mean TPR at FPR <= 0.1% over its own chance level (the best of several: a figure that favours "
        "the attacker, not corrected for the choice); its mean over seeds [95% t interval over seeds, its low end "
        "shown at 0 where it is below] and its AUC, mean over seeds [95% t interval; chance 0.5, * above it]. "
        "Below 1000 non-members FPR <= 0.1% allows no false positive, so the figure is the TPR at zero "
        "false positives. Its chance is the TPR a score that ignores the model expects from the same counts: "
        "with n non-members, "
        "(floor(0.001 n) + 1) / (n + 1): 1 / (n + 1) below 1000 non-members, above 0.1% whatever n is, "
        "and each row prints its own; * marks an interval wholly above it. Cost: tensor megabytes per "
        "client, sent (up) and received (down), for training (its secure-aggregation stages included) and for "
        "evaluation (an evaluation reply carries metrics, no tensor: its up is 0), over the run; seconds per round "
        "(each run's median round, averaged over seeds). `-`: not "
        "measured for that row (no mechanism to audit, no attack that applies, no reference, traffic a run made "
        "before training and evaluation were counted apart recorded only as totals).",
    ]


def board_markdown(entries: list[dict], command: str, seconds: float, title: str = TITLE) -> list[str]:
    """The board's page: its header (how it was measured, what each column means) and each
    family's tables."""
    runs = sum(e["seeds"] for e in entries if "failed" not in e)
    spent = sum(e["seconds-total"] for e in entries if "failed" not in e)
    lines = [
        f"# {title}",
        "",
        f"Measured with `{command}`: {runs} runs, whose rounds took {spent / 3600:.1f} h in total (the sum of "
        "their own per-round seconds; the audits and attacks after each run add to it). This call took "
        f"{seconds / 60:.0f} min: finished runs are reused, so a resumed board counts only what it ran. "
        f"Machine, as the runs recorded it: {provenance(entries, 'machines')}. Code, as the runs recorded it: "
        f"{provenance(entries, 'code')}. Backbone weights, as the runs recorded them: "
        f"{provenance(entries, 'backbones')}.{mixed_backbones(entries)}",
        "",
        *legend(entries),
    ]
    for family in dict.fromkeys(e["family"] for e in entries):
        mine = [e for e in entries if e["family"] == family and "failed" not in e]
        lines += ["", f"## {family} family ({FAMILIES[family].default_dataset})", "", *family_tables(mine)]
        targets: dict[tuple[str, str], list[str]] = {}  # a method's rows with one reason: one line
        for e in mine:
            if "attack-note" in e:
                targets.setdefault((e["variant"], e["attack-note"]), []).append(e["target"])
        if targets:
            notes = [f"- {variant} ({', '.join(ts)}): {note}" for (variant, note), ts in targets.items()]
            lines += ["", "Attack columns left empty:", "", *notes]
    failed = [e for e in entries if "failed" in e]
    if failed:
        lines += ["", "Runs that failed (the board went on without them):", ""]
        lines += [f"- {e['family']} / {e['variant']} at epsilon {e['epsilon']}: {e['failed']}" for e in failed]
    return lines


def write_outputs(entries: list[dict], out: Path, stem: str, lines: list[str], command: str, extra: dict) -> None:
    """``<stem>.json`` (the entries, with ``extra``), ``.csv``, ``.md`` (``lines`` and the plot)
    and ``_pareto.png`` in ``out``, each written whole (a reader never sees half a file); the plot
    first, so that a board that cannot be drawn replaces none of the files of the one before."""
    plot = f"{stem}_pareto.png"
    plot_pareto(entries, out / plot)
    atomic_write_json(
        {
            "command": command,
            "machines": provenance(entries, "machines"),
            "code": provenance(entries, "code"),
            "backbones": provenance(entries, "backbones"),
            "entries": entries,
            **extra,
        },
        out / f"{stem}.json",
    )
    atomic_write_records(entries, out / f"{stem}.csv")
    atomic_write_text(
        "\n".join([*lines, "", f"![utility against accounted epsilon and the attack]({plot})", ""]), out / f"{stem}.md"
    )


def copy_to_docs(out: Path, stem: str) -> None:
    """The board's files into docs/results/, each whole (a reader of the docs never sees half)."""
    for end in (".md", ".csv", "_pareto.png", ".json"):
        atomic_copy(out / f"{stem}{end}", DOCS / f"{stem}{end}")


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats on both counts (lower x, higher y), by x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


MARKERS = "os^Dv<>PX*"


def target_label(target: str) -> str:
    """A row's privacy target as a legend says it: 'target eps 8', 'no DP', 'no target (z=1.1)'."""
    if target == "none":
        return "no DP"
    return f"no target ({target.removeprefix('none (')}" if target.startswith("none (") else f"target eps {target}"


def plot_pareto(entries: list[dict], path: Path) -> None:
    """Utility against the epsilon accounted (left) and against the best attack's TPR (right), a
    row of both per family; a board of failed runs only gets a figure that says so.

    A method is a colour and a privacy target a marker, both in legends, so no point carries a
    label that could cover another's.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in dict.fromkeys(e["family"] for e in entries if "failed" not in e)]
    fig, axes = plt.subplots(max(1, len(families)), 2, figsize=(12, 4.6 * max(1, len(families))), squeeze=False)
    if not families:
        axes[0][0].text(0.5, 0.5, "no finished run", ha="center", va="center", transform=axes[0][0].transAxes)
    for (left, right), family in zip(axes, families, strict=False):
        _family_panels(left, right, family, [e for e in entries if e["family"] == family and "failed" not in e])
    fig.tight_layout()
    atomic_savefig(fig, path, 110)
    plt.close(fig)


def _family_panels(left, right, family: str, mine: list[dict]) -> None:
    """One family's two panels: its first utility every row has (FedPara has no server model, so
    no server CIDEr) against the accounted epsilon and against the row's attack."""
    utility = utility_columns([{k + LAST10: v for k, v in e.items()} for e in mine])
    if not utility:
        return
    u = next((c for c in utility if all(e.get(c) is not None for e in mine)), utility[0])
    colours = {m: f"C{k % 10}" for k, m in enumerate(dict.fromkeys(e["variant"] for e in mine))}
    markers = {t: MARKERS[k % len(MARKERS)] for k, t in enumerate(dict.fromkeys(e["target"] for e in mine))}
    finite = sorted({e[SPENT] for e in mine if e.get(SPENT)})
    none_x = 2 * finite[-1] if finite else 1.0  # where runs without noise sit: right of every private one
    for ax, xkey in ((left, SPENT), (right, ATTACK_TPR)):
        pts = _points(ax, mine, u, xkey, none_x, colours, markers, attack=ax is right)
        # a front over attacks with different chance levels (the VLM server's and clients') compares
        # figures on different scales: drawn only where every row's attack has the same chance
        levels = {round(e[ATTACK_TPR + CHANCE], 9) for e in mine if e.get(ATTACK_TPR + CHANCE) is not None}
        if pts and (ax is left or len(levels) <= 1):
            fx, fy = zip(*pareto_front(pts), strict=True)
            ax.step(fx, fy, where="post", color="gray", ls="--", lw=1)
        if ax is left:
            _epsilon_axis(ax, mine, finite, none_x)
            ax.set_title(f"{family} family: {u} against privacy spent")
        else:
            chances = [100 * e[ATTACK_TPR + CHANCE] for e in mine if e.get(ATTACK_TPR) is not None]
            intervals = [e.get(ATTACK_TPR + CI) or (None, None) for e in mine]
            highs = [100 * high for _, high in intervals if high is not None]
            top = max([*(2.5 * c for c in chances), *(x for x, _ in pts), *highs, 0.1])
            ax.set_xlim(-0.04 * top, 1.08 * top)  # a TPR of 0 (nothing found at that FPR) must show
            ax.set_xlabel("the named attack's TPR at FPR <= 0.1% (%), 95% interval over seeds")
            ax.set_title(f"{family} family: {u} against privacy measured")
        several = any(e.get(u + STD) is not None for e in mine)
        ax.set_ylabel(f"{u} ({METRICS[u].kind.axis})" + (", mean ± std over seeds" if several else ""))
        ax.grid(alpha=0.3)
    _legends(left, right, colours, markers)


def _points(ax, mine, u: str, xkey: str, none_x: float, colours, markers, attack: bool) -> list[tuple[float, float]]:
    """Each row's point (its spread over seeds as an error bar; on the attack panel its TPR's 95%
    interval too, its low end at 0) and, on the attack panel, its own chance level at its height:
    below 1000 non-members it is not 0.1%."""
    scale, xscale = METRICS[u].kind.scale, 100.0 if attack else 1.0
    pts = []
    for e in mine:
        y, x = e.get(u), e.get(xkey)
        if x is None and xkey == SPENT:
            x = none_x
        if y is None or x is None:
            continue
        pts.append((x * xscale, y * scale))
        spread, (low, high) = e.get(u + STD), (e.get(xkey + CI) or (None, None)) if attack else (None, None)
        ax.errorbar(
            x * xscale,
            y * scale,
            yerr=None if spread is None else spread * scale,
            xerr=None if low is None or high is None else [[(x - max(low, 0.0)) * xscale], [(high - x) * xscale]],
            fmt=markers[e["target"]],
            color=colours[e["variant"]],
            ms=7,
            alpha=0.85,
            capsize=3,
        )
        if attack:
            ax.plot(e[ATTACK_TPR + CHANCE] * 100, y * scale, marker="|", ms=12, mew=2, color="gray")
    return pts


def _epsilon_ticks(finite: list[float], apart: float = 1.4) -> tuple[list[float], list[str]]:
    """One tick per group of accounted epsilons within a factor ``apart`` of their neighbour (the
    rows of one target land a little apart, and their labels would print over each other),
    labelled with the group's range (one figure where its ends print alike) and placed at its
    geometric middle."""
    groups: list[list[float]] = []
    for value in sorted(finite):
        if groups and value <= groups[-1][-1] * apart:
            groups[-1].append(value)
        else:
            groups.append([value])
    ends = [dict.fromkeys(f"{v:.3g}" if len(g) == 1 or v >= 10 else f"{v:.2g}" for v in (g[0], g[-1])) for g in groups]
    return [math.sqrt(g[0] * g[-1]) for g in groups], ["-".join(e) for e in ends]


def _epsilon_axis(ax, mine: list[dict], finite: list[float], none_x: float) -> None:
    ax.set_xscale("log")
    unaccounted = any(not e.get(SPENT) for e in mine)  # a family with fixed noise has none
    ticks, labels = _epsilon_ticks(finite)
    ax.set_xticks([*ticks, none_x] if unaccounted else ticks, labels + (["no DP"] if unaccounted else []))
    ax.minorticks_off()
    ax.set_xlabel("epsilon spent, per record (log scale)")


def _legends(left, right, colours: dict, markers: dict) -> None:
    from matplotlib.lines import Line2D

    front = Line2D([], [], color="gray", ls="--", label="non-dominated")
    methods = [Line2D([], [], color=c, marker="o", ls="", label=m) for m, c in colours.items()]
    targets = [Line2D([], [], color="dimgray", marker=mk, ls="", label=target_label(t)) for t, mk in markers.items()]
    left.legend(handles=[*methods, *targets, front], fontsize=7, loc="best", ncol=2)
    chance = Line2D([], [], color="gray", marker="|", ms=12, mew=2, ls="", label="its chance (from its non-members)")
    right.legend(handles=[front, chance], fontsize=7, loc="best")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.leaderboard", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=None, help="default: ~/fedvlm-leaderboard (~/fedvlm-leaderboard-quick with --quick)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a CI-sized board: 2 rounds, 3 clients, one seed, eps none and 1"
    )
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families (default: all)")
    p.add_argument("--methods", default="", help="comma-separated methods (default: every method of each family)")
    p.add_argument("--seeds", type=whole_numbers, default="", help="override the scale's seeds, e.g. 0,1")
    p.add_argument("--docs", action="store_true", help="also write docs/results/leaderboard.md and its plot")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.docs and not DOCS.is_dir():  # checked now, not after hours of runs
        p.error(f"--docs writes into a checkout's docs/results ({DOCS} does not exist): run it from a git checkout")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    scale = QUICK if args.quick else FULL
    if args.seeds:
        scale = dataclasses.replace(scale, seeds=args.seeds)
    chosen = set(args.methods.split(",")) - {""}
    for name in chosen:
        try:
            get_method(name)  # an unknown method fails now, not hours in
        except ValueError as err:  # the table's own refusal (UnknownMethod), said as the argument's
            p.error(f"--methods: {err}")
    plan = []
    for family in args.families.split(","):
        if family not in FAMILIES:
            p.error(f"--families: {family!r} is not one of {', '.join(FAMILIES)}")
        methods = [m.name for m in methods_of(FAMILIES[family]) if not chosen or m.name in chosen]
        if methods:
            plan.append((family, methods))
    if not plan:  # an empty board would replace the one in --out
        p.error(f"--methods {args.methods} has no method of --families {args.families}: nothing to run")
    # a quick board's runs are named like the full board's: apart by default, so neither meets the other's
    out = (args.out or Path.home() / ("fedvlm-leaderboard-quick" if args.quick else "fedvlm-leaderboard")).expanduser()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows: list[dict] = []
    made, made_seconds = 0, 0.0  # the runs this call trained (a reused one costs nothing), for the estimate
    for i, (family, methods) in enumerate(plan, 1):
        log.info("leaderboard: family %s (%d/%d): %s", family, i, len(plan), ", ".join(methods))
        names = planned(methods, scale)
        fresh, t = unfinished(out / family, names), time.time()
        rows += run_family(family, methods, scale, out, args.quick)
        # every planned run is finished now, or failed: made in this call
        made, made_seconds = made + fresh, made_seconds + (time.time() - t if fresh else 0.0)
        later = sum(unfinished(out / f, planned(ms, scale)) for f, ms in plan[i:])
        estimate = time_left(made, made + later, made_seconds) if later else "done"
        log.info(
            "leaderboard: %d/%d families done (%s: %d runs made, %d reused), %s",
            *(i, len(plan), family, fresh, sum(map(len, names.values())) - fresh),
            estimate or "no estimate yet (no run made so far)",
        )
    entries = board(rows)
    command = "python -m fedvlm.experiments.leaderboard " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = board_markdown(entries, command.strip(), time.time() - t0)
    write_outputs(entries, out, STEM, lines, command, {})
    if args.docs:
        copy_to_docs(out, STEM)
    print((out / f"{STEM}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
