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
- cost: megabytes each client sent and received, seconds per round, on the machine named in the
  table's header.

Writes ``leaderboard.md``, ``.csv``, ``.json`` and ``leaderboard_pareto.png`` (utility against
accounted epsilon and against the best attack's TPR, a bar for the spread over seeds, the
non-dominated points joined) in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import logging
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvlm.experiments import sweep
from fedvlm.experiments.sweep_report import LAST10, read_summary, utility_columns
from fedvlm.methods.registry import FAMILIES, get_method, methods_of
from fedvlm.metrics import AUDIT_METRICS, METRICS
from fedvlm.utils.progress import time_left

log = logging.getLogger("leaderboard")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "results"
# a utility column's spread over seeds, in the board's rows and its JSON: "<column>-std"
STD = "-std"
TPR, AUC = "tpr@0.1%fpr", "auc"


@dataclass(frozen=True)
class Scale:
    """How big the board is: what every family's runs get."""

    epsilons: tuple[str, ...]
    seeds: tuple[int, ...]
    clients: int
    audit: int  # canaries of the one-run audit
    shadows: int  # shadow federations of the membership attacks
    sets: tuple[str, ...]  # run-config overrides for every run


FULL = Scale(("none", "8", "1"), (0, 1, 2), 10, 100, 2, ())
QUICK = Scale(("none", "1"), (0,), 3, 20, 1, ("num-server-rounds=2", "max-per-class=6", "vlm.eval-samples=3"))
# the reprogramming family's quick check: the digits task on its 93 k-weight source (the motif
# source of its embedded default needs minutes of pretraining first)
QUICK_FAMILY = {"reprogram": ("dataset=digits", "reprogram.local-iterations=2")}


def run_family(family: str, methods: list[str], scale: Scale, out: Path, quick: bool) -> list[dict]:
    """Every run of ``methods`` through the sweep (resumed where it stopped); its summary's rows."""
    folder = out / family
    argv = [
        "--out",
        str(folder),
        "--methods",
        ",".join(methods),
        "--epsilons",
        ",".join(scale.epsilons),
        "--seeds",
        ",".join(map(str, scale.seeds)),
        "--clients",
        str(scale.clients),
        "--mia",
        "--shadows",
        str(scale.shadows),
        "--audit",
        str(scale.audit),
    ]
    sets = [*scale.sets, *(QUICK_FAMILY.get(family, ()) if quick else ())]
    if sets:
        argv += ["--set", *sets]
    sweep.main(argv)
    return [{**r, "family": family} for r in read_summary(folder / "summary.csv")]


def planned(methods: list[str], scale: Scale) -> set[str]:
    """The run folders a family's board makes: each method (at the sweep's default rank) at each
    privacy level it has, at each seed."""
    return {
        sweep.run_name(label, eps, seed)
        for label, method, _ in sweep.method_variants(methods, [int(sweep.RANK)], [True])
        for eps in scale.epsilons
        if eps == "none" or get_method(method).supports_dp
        for seed in scale.seeds
    }


def unfinished(folder: Path, names: set[str]) -> set[str]:
    """Those of ``names`` a family's board still has to make."""
    return names - finished(folder, names)


def finished(folder: Path, names: set[str]) -> set[str]:
    """Those of ``names`` a family's folder holds finished (which its sweep reuses)."""
    found = set()
    for name in names:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads((folder / "runs" / name / "results.json").read_text())["run"].get("status") in sweep.REUSED:
                found.add(name)
    return found


def best_attack(row: dict) -> tuple[str, float, float | None] | None:
    """The attack with the highest TPR at 0.1% FPR in a sweep row: (name, TPR, AUC)."""
    found = [
        (k[len("mia-") : -len(f"-{TPR}")], row[k], row.get(k.replace(TPR, AUC)))
        for k in row
        if k.startswith("mia-") and k.endswith(f"-{TPR}") and row[k] is not None
    ]
    return max(found, key=lambda f: f[1]) if found else None


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and np.isfinite(float(v))]
    return float(np.mean(vals)) if vals else None


def board(rows: list[dict]) -> list[dict]:
    """One entry per family, method and target epsilon: the seeds' runs combined."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family and r["status"] != "failed"]
        utility = utility_columns(mine)
        for method, eps in dict.fromkeys((r["method"], r["epsilon"]) for r in mine):
            runs = [r for r in mine if r["method"] == method and r["epsilon"] == eps]
            attacks = [a for a in (best_attack(r) for r in runs) if a is not None]
            z = runs[0].get("noise-multiplier")
            # 'none' asks for no epsilon target; a family with fixed noise (Reprogrammable-FL's z = 1.1) still adds it
            target = f"none (z={z:g})" if eps == "none" and z else eps
            entry: dict = {"family": family, "method": method, "epsilon": eps, "target": target, "seeds": len(runs)}
            for name in utility:
                vals = [r[name + LAST10] for r in runs if r.get(name + LAST10) is not None]
                entry[name] = _mean(vals)
                entry[name + STD] = float(np.std(vals)) if len(vals) > 1 else None
            entry["epsilon-accounted"] = _mean(r.get("epsilon-spent") for r in runs)
            entry["audit-lower-bound"] = _mean(r.get(AUDIT_METRICS["epsilon-lower"]) for r in runs)
            notes = [r["mia-error"] for r in runs if r.get("mia-error")]
            if notes:  # why the attack columns are empty (or rest on fewer seeds)
                entry["attack-note"] = notes[0]
            if attacks:
                name, _, _ = max(attacks, key=lambda a: a[1])
                entry["best-attack"] = name
                entry["attack-tpr@0.1%fpr"] = _mean(a[1] for a in attacks)
                entry["attack-auc"] = _mean(a[2] for a in attacks)
            for key in ("mb-up-per-client", "mb-down-per-client", "seconds-per-round"):
                entry[key] = _mean(r.get(key) for r in runs)
            entry["seconds-total"] = sum(r.get("seconds-total") or 0.0 for r in runs)
            entry["machines"] = dict(Counter(str(r.get("machine") or "not recorded") for r in runs))
            accounted = {(r["accountant"], r["delta"]) for r in runs if r.get("accountant")}
            entry["accounting"] = [{"accountant": a, "delta": d} for a, d in sorted(accounted)]
            out.append(entry)
    failed = [r for r in rows if r["status"] == "failed"]
    for r in failed:
        out.append(
            {"family": r["family"], "method": r["method"], "epsilon": r["epsilon"], "failed": r.get("error", "")}
        )
    return out


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def accounting(entries: list[dict]) -> str:
    """The accountants and deltas the board's accounted epsilons are under (one, unless a run was
    made with another ``privacy.accountant`` or ``privacy.delta``)."""
    pairs = dict.fromkeys((a["accountant"], a["delta"]) for e in entries for a in e.get("accounting") or [])
    return " and ".join(f"{a.upper()} at delta {d:g}" for a, d in pairs) or "no accountant (no private run)"


def machines(entries: list[dict]) -> str:
    """Where the runs' seconds were measured (each run records its host and its nodes' devices)."""
    count: Counter[str] = Counter()
    for e in entries:
        count.update(e.get("machines") or {})
    return "; ".join(f"{m} ({n} runs)" if len(count) > 1 else m for m, n in count.items())


def write_markdown(entries: list[dict], path: Path, command: str, seconds: float) -> None:
    runs = sum(e["seeds"] for e in entries if "failed" not in e)
    spent = sum(e["seconds-total"] for e in entries if "failed" not in e)
    lines = [
        "# Leaderboard: utility, privacy and cost of every method on the embedded default",
        "",
        f"Measured with `{command}`: {runs} runs, whose rounds took {spent / 3600:.1f} h in total (the sum of "
        "their own per-round seconds; the audits and attacks after each run add to it). This call took "
        f"{seconds / 60:.0f} min: finished runs are reused, so a resumed board counts only what it ran. "
        f"Machine, as the runs recorded it: {machines(entries)}.",
        "",
        "Utility: mean of the last 10 rounds, averaged over the row's seeds, ± their standard deviation "
        "(numpy's, ddof 0); the rest is the seeds' mean (for the attack, the mean of each seed's best attack, "
        "named by the one that did best in any seed). Privacy: the target epsilon, the epsilon the "
        "run's ledger accounted per record (every mechanism composed; the most any client spent, under "
        f"{accounting(entries)}), the one-run audit's lower bound (one node, "
        "its local mechanism), and the best membership attack's TPR at 0.1% FPR and AUC (chance: 0.001 and 0.5). "
        "Cost: tensor megabytes per client sent (up) and received (down) over the run, seconds per round. "
        "`-`: not measured for that row (no mechanism to audit, no attack that applies).",
    ]
    for family in dict.fromkeys(e["family"] for e in entries):
        mine = [e for e in entries if e["family"] == family and "failed" not in e]
        utility = utility_columns([{k + LAST10: v for k, v in e.items()} for e in mine])
        head = [
            "method",
            "target eps",
            "seeds",
            *(f"{u} ({METRICS[u].kind.unit})" if METRICS[u].kind.unit else u for u in utility),
            "accounted eps",
            "audit lower bound",
            "best attack",
            "TPR@0.1%FPR",
            "AUC",
            "MB up",
            "MB down",
            "s/round",
        ]
        lines += ["", f"## {family} family ({FAMILIES[family].default_dataset})", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in mine:
            cells = [
                e["method"],
                e["target"],
                str(e["seeds"]),
                *(
                    _fmt(e.get(u), METRICS[u].kind.scale)
                    + ("" if e.get(u + STD) is None else f" ± {_fmt(e[u + STD], METRICS[u].kind.scale)}")
                    for u in utility
                ),
                _fmt(e.get("epsilon-accounted"), digits=3),
                _fmt(e.get("audit-lower-bound"), digits=3),
                e.get("best-attack", "-"),
                _fmt(e.get("attack-tpr@0.1%fpr"), digits=4),
                _fmt(e.get("attack-auc"), digits=3),
                _fmt(e.get("mb-up-per-client"), digits=3),
                _fmt(e.get("mb-down-per-client"), digits=3),
                _fmt(e.get("seconds-per-round"), digits=1),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        targets: dict[tuple[str, str], list[str]] = {}  # a method's rows with one reason: one line
        for e in mine:
            if "attack-note" in e:
                targets.setdefault((e["method"], e["attack-note"]), []).append(e["target"])
        if targets:
            notes = [f"- {method} ({', '.join(ts)}): {note}" for (method, note), ts in targets.items()]
            lines += ["", "Attack columns left empty:", "", *notes]
    failed = [e for e in entries if "failed" in e]
    if failed:
        lines += ["", "Runs that failed (the board went on without them):", ""]
        lines += [f"- {e['family']} / {e['method']} at epsilon {e['epsilon']}: {e['failed']}" for e in failed]
    lines += ["", "![utility against accounted epsilon and the best attack](leaderboard_pareto.png)", ""]
    path.write_text("\n".join(lines))


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats on both counts (lower x, higher y), by x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


# Chance for a membership attack: at a false-positive rate of 0.1% a guess that ignores the model
# finds members at the same rate, so a TPR at or below this line measures nothing.
CHANCE_TPR = 0.001
MARKERS = "os^Dv<>PX*"


def target_label(target: str) -> str:
    """A row's privacy target as a legend says it: 'target eps 8', 'no DP', 'no target (z=1.1)'."""
    if target == "none":
        return "no DP"
    return f"no target ({target.removeprefix('none (')}" if target.startswith("none (") else f"target eps {target}"


def plot_pareto(entries: list[dict], path: Path) -> None:
    """Utility against the epsilon accounted (left) and against the best attack's TPR (right).

    A method is a colour and a privacy target a marker, both in legends, so no point carries a
    label that could cover another's.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    families = [f for f in dict.fromkeys(e["family"] for e in entries if "failed" not in e)]
    fig, axes = plt.subplots(len(families), 2, figsize=(12, 4.6 * len(families)), squeeze=False)
    for (left, right), family in zip(axes, families, strict=True):
        mine = [e for e in entries if e["family"] == family and "failed" not in e]
        utility = utility_columns([{k + LAST10: v for k, v in e.items()} for e in mine])
        if not utility:
            continue
        # the family's first utility every row has (FedPara has no server model, so no server CIDEr)
        u = next((c for c in utility if all(e.get(c) is not None for e in mine)), utility[0])
        scale = METRICS[u].kind.scale
        colours = {m: f"C{k % 10}" for k, m in enumerate(dict.fromkeys(e["method"] for e in mine))}
        markers = {t: MARKERS[k % len(MARKERS)] for k, t in enumerate(dict.fromkeys(e["target"] for e in mine))}
        finite = sorted({e["epsilon-accounted"] for e in mine if e.get("epsilon-accounted")})
        none_x = 2 * finite[-1] if finite else 1.0  # where runs without noise sit: right of every private one
        for ax, xkey in ((left, "epsilon-accounted"), (right, "attack-tpr@0.1%fpr")):
            xscale = 1.0 if ax is left else 100.0
            pts = []
            for e in mine:
                y, x = e.get(u), e.get(xkey)
                if x is None and xkey == "epsilon-accounted":
                    x = none_x
                if y is None or x is None:
                    continue
                pts.append((x * xscale, y * scale))
                spread = e.get(u + STD)  # a row over several seeds shows their spread, not only their mean
                ax.errorbar(
                    x * xscale,
                    y * scale,
                    yerr=None if spread is None else spread * scale,
                    fmt=markers[e["target"]],
                    color=colours[e["method"]],
                    ms=7,
                    alpha=0.85,
                    capsize=3,
                )
            if pts:
                fx, fy = zip(*pareto_front(pts), strict=True)
                ax.step(fx, fy, where="post", color="gray", ls="--", lw=1)
            if ax is left:
                ax.set_xscale("log")
                unaccounted = any(not e.get("epsilon-accounted") for e in mine)  # a family with fixed noise has none
                ticks = [*finite, none_x] if unaccounted else finite
                ax.set_xticks(ticks, [f"{t:.3g}" for t in finite] + (["no DP"] if unaccounted else []))
                ax.minorticks_off()
                ax.set_xlabel("accounted epsilon (log scale)")
                ax.set_title(f"{family} family: {u} against privacy spent")
            else:
                ax.axvline(CHANCE_TPR * 100, color="black", lw=1, ls=":")
                top = max([CHANCE_TPR * 100 * 2.5, *(x for x, _ in pts)])
                ax.set_xlim(-0.04 * top, 1.08 * top)  # a TPR of 0 (nothing found at that FPR) must show
                ax.set_xlabel("best membership attack's TPR at 0.1% FPR (%)")
                ax.set_title(f"{family} family: {u} against privacy measured")
            several = any(e.get(u + STD) is not None for e in mine)
            ax.set_ylabel(f"{u} ({METRICS[u].kind.axis})" + (", mean ± std over seeds" if several else ""))
            ax.grid(alpha=0.3)
        methods = [Line2D([], [], color=c, marker="o", ls="", label=m) for m, c in colours.items()]
        targets = [
            Line2D([], [], color="dimgray", marker=mk, ls="", label=target_label(t)) for t, mk in markers.items()
        ]
        left.legend(
            handles=[*methods, *targets, Line2D([], [], color="gray", ls="--", label="non-dominated")],
            fontsize=7,
            loc="best",
            ncol=2,
        )
        right.legend(
            handles=[
                Line2D([], [], color="gray", ls="--", label="non-dominated"),
                Line2D([], [], color="black", ls=":", label="chance (TPR = FPR = 0.1%)"),
            ],
            fontsize=7,
            loc="best",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.leaderboard", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=None, help="default: ~/fedvlm-leaderboard (~/fedvlm-leaderboard-quick with --quick)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a CI-sized board: 2 rounds, 3 clients, one seed, eps none and 1"
    )
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families (default: all)")
    p.add_argument("--methods", default="", help="comma-separated methods (default: every method of each family)")
    p.add_argument("--seeds", default="", help="override the scale's seeds, e.g. 0,1")
    p.add_argument("--docs", action="store_true", help="also write docs/results/leaderboard.md and its plot")
    args = p.parse_args(argv)
    if args.docs and not DOCS.is_dir():  # checked now, not after hours of runs
        p.error(f"--docs writes into a checkout's docs/results ({DOCS} does not exist): run it from a git checkout")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    scale = QUICK if args.quick else FULL
    if args.seeds:
        scale = dataclasses.replace(scale, seeds=tuple(int(s) for s in args.seeds.split(",")))
    chosen = set(args.methods.split(",")) - {""}
    for name in chosen:
        get_method(name)  # an unknown method fails now, not hours in
    # a quick board's runs are named like the full board's: apart by default, so neither meets the other's
    out = (args.out or Path.home() / ("fedvlm-leaderboard-quick" if args.quick else "fedvlm-leaderboard")).expanduser()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = []
    for family in args.families.split(","):
        if family not in FAMILIES:
            p.error(f"--families: {family!r} is not one of {', '.join(FAMILIES)}")
        methods = [m.name for m in methods_of(FAMILIES[family]) if not chosen or m.name in chosen]
        if methods:
            plan.append((family, methods))
    t0 = time.time()
    rows: list[dict] = []
    made, made_seconds = 0, 0.0  # the runs this call trained (a reused one costs nothing), for the estimate
    for i, (family, methods) in enumerate(plan, 1):
        log.info("leaderboard: family %s (%d/%d): %s", family, i, len(plan), ", ".join(methods))
        names = planned(methods, scale)
        before, t = finished(out / family, names), time.time()
        rows += run_family(family, methods, scale, out, args.quick)
        fresh = len(names) - len(before)  # every planned run is finished now, or failed: made in this call
        made, made_seconds = made + fresh, made_seconds + (time.time() - t if fresh else 0.0)
        later = sum(len(unfinished(out / f, planned(ms, scale))) for f, ms in plan[i:])
        estimate = time_left(made, made + later, made_seconds) if later else "done"
        log.info(
            "leaderboard: %d/%d families done (%s: %d runs made, %d reused), %s",
            *(i, len(plan), family, fresh, len(before)),
            estimate or "no estimate yet (no run made so far)",
        )
    entries = board(rows)
    command = "python -m fedvlm.experiments.leaderboard " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "leaderboard.json").write_text(
        json.dumps({"command": command, "machines": machines(entries), "entries": entries}, indent=1)
    )
    with open(out / "leaderboard.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for e in entries for k in e)))
        writer.writeheader()
        writer.writerows(entries)
    write_markdown(entries, out / "leaderboard.md", command.strip(), time.time() - t0)
    plot_pareto(entries, out / "leaderboard_pareto.png")
    if args.docs:
        shutil.copy(out / "leaderboard.md", DOCS / "leaderboard.md")
        shutil.copy(out / "leaderboard_pareto.png", DOCS / "leaderboard_pareto.png")
        shutil.copy(out / "leaderboard.json", DOCS / "leaderboard.json")
    print((out / "leaderboard.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
