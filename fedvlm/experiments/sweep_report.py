"""A sweep's rows as tables and figures in its ``--out`` folder: a table per metric (variants x
epsilon, mean ± std over seeds, the paper's number beside ours where the preset has one), the
failed runs, the one-run audits, and the accuracy, MIA and audit plots."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from fedvlm.experiments import stats
from fedvlm.metrics import ACC, AUDIT_METRICS, CIDER, METRICS, PER_CLIENT, PROPORTION
from fedvlm.utils.files import (
    UnreadableFile,
    atomic_savefig,
    atomic_write_csv,
    atomic_write_records,
    atomic_write_text,
    read_utf8,
)

LAST10 = "-last10-mean"  # results.json's summary: a headline figure's mean over the last 10 rounds
SPENT = "epsilon-spent"  # the epsilon a run's noise gives (per record, every mechanism composed): one name, every table


def shown_scale(column: str) -> float:
    """What a row's ``column`` (a figure, or its ``LAST10`` mean) is multiplied by in a table:
    its kind's (a proportion shown as a percentage), 1 for a column that is no declared figure."""
    name = column.removesuffix(LAST10)
    return METRICS[name].kind.scale if name in METRICS else 1.0


UTILITY_KINDS = (PROPORTION, CIDER)  # what a family's utility columns are: its headline accuracies or CIDEr


def utility_columns(rows: list[dict]) -> list[str]:
    """A family's utility: the headline figures of a utility kind its runs report (the
    federation's figures; their spread over nodes goes beside them, ``metrics.per_client``)."""
    return [
        m.name
        for m in METRICS.values()
        if m.headline
        and m.kind in UTILITY_KINDS
        and not (m.combine is not None and m.combine.statistic in PER_CLIENT)
        and any(r.get(m.name + LAST10) is not None for r in rows)
    ]


def _fmt(values: list[float | None], scale: float = 100.0) -> str:
    """'mean ± std' over seeds (ddof 1, ``experiments.stats``)."""
    figure = stats.spread(values)
    return "-" if figure is None else figure.text(scale)


TEXT_COLUMNS = (
    "variant",
    "method",
    "epsilon",
    "status",
    "error",
    "mia-error",
    "audit-node",
    "audit-status",
    "machine",
    "code",
    "backbone",
    "accountant",
)


def summary_rows(path: Path) -> list[dict[str, str]]:
    """summary.csv's rows as the text it holds (none before a first run)."""
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def order_summary(path: Path, labels: list[str], epsilons: tuple[str, ...]) -> None:
    """summary.csv ordered by variant (``labels`` first, then the rest as found), privacy level and
    seed. A sweep keeps the rows of a folder's earlier calls (``sweep.Sweep.earlier``), so a
    folder's runs made call by call (a protocol's parts, a family's later seeds) all reach its page;
    this gives them one order whichever call ran last."""
    rows = summary_rows(path)
    if not rows:  # a sweep that ran nothing leaves no summary to order (an empty file would not read back)
        return
    labels = [*labels, *dict.fromkeys(r["variant"] for r in rows if r["variant"] not in labels)]
    rank = {e: i for i, e in enumerate(epsilons)}
    rows.sort(key=lambda r: (labels.index(r["variant"]), rank.get(r["epsilon"], len(rank)), float(r["seed"])))
    atomic_write_records(rows, path)


def read_summary(path: Path) -> list[dict]:
    """A sweep's summary.csv as the rows it wrote: numbers as floats, an empty cell as None."""

    def cell(key: str, text: str):
        if text == "" or key in TEXT_COLUMNS:
            return text if key in TEXT_COLUMNS else None
        try:
            return float(text)
        except ValueError:
            return text

    fix = "run the sweep again with the same --out: it writes summary.csv afresh from its run folders"
    reader = csv.DictReader(io.StringIO(read_utf8(path, fix), newline=""))
    missing = [c for c in ("variant", "epsilon", "seed", "status") if c not in (reader.fieldnames or [])]
    if missing:
        raise UnreadableFile(f"{path} is not a sweep's summary (no column {', '.join(missing)}): {fix}")
    rows = []
    for r in reader:
        if None in r:  # more cells than the header names
            raise UnreadableFile(f"{path} line {reader.line_num} has more cells than columns: {fix}")
        if None in r.values():  # fewer (a row cut short)
            raise UnreadableFile(f"{path} line {reader.line_num} has fewer cells than columns: {fix}")
        rows.append({k: cell(k, v) for k, v in r.items()})
    return rows


def write_failures(rows: list[dict], out: Path) -> None:
    """table_failures.md: every run that could not run or did not finish, with its reason."""
    failed = [r for r in rows if r["status"] == "failed"]
    path = out / "table_failures.md"
    if not failed:
        path.unlink(missing_ok=True)
        return
    lines = ["| variant | epsilon | seed | why |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['epsilon']} | {r['seed']} | {r['error'].replace('|', '/')} |" for r in failed]
    atomic_write_text("Runs that failed (the sweep went on without them)\n\n" + "\n".join(lines) + "\n", path)


def write_table(out: Path, tag: str, head: str, table: list[list[str]]) -> None:
    """``table_<tag>.csv`` and ``.md`` (``head`` above the table), each written whole."""
    atomic_write_csv(table, out / f"table_{tag}.csv")
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(r) + " |" for r in table[1:]]
    atomic_write_text(head + "\n\n" + "\n".join(md) + "\n", out / f"table_{tag}.md")


# the prompt family's accuracy tables keep the names DP-FPL's tables had (table_local.md, ...)
TABLE_TAGS = {ACC["local"]: "local", ACC["neighbor"]: "neighbor"}


def utility_tables(rows: list[dict]) -> list[tuple[str, str, float, str]]:
    """(tag, row key, scale, heading) of a table per utility column of the family: the mean of its
    last 10 rounds (table_local.md and table_neighbor.md for accuracy, table_<figure>.md else)."""
    out = []
    for u in utility_columns(rows):
        kind = METRICS[u].kind
        classes = {ACC["local"]: " (local classes)", ACC["neighbor"]: " (neighbor classes)"}.get(u)
        head = (
            f"Mean of the last 10 rounds{classes}, %" if classes else f"Mean of the last 10 rounds, {u} ({kind.unit})"
        )
        out.append((TABLE_TAGS.get(u, u), u + LAST10, kind.scale, head))
    return out


def write_tables(rows: list[dict], out: Path, epsilons: list[str], reference: dict | None = None) -> list[str]:
    """One table per metric, variants x epsilon (the family's utility, accuracy after the last
    round where the family has it, the prompt family's Shokri and loss-threshold attacks); their
    tags, the utility's first. ``reference`` ((variant, epsilon) -> the paper's accuracy in %)
    adds a paper column beside each of ours in the final-accuracy table."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    metrics = [(tag, key, scale) for tag, key, scale, _ in utility_tables(rows)]
    heads = {tag: head for tag, _, _, head in utility_tables(rows)}
    if any(r.get(ACC["local"]) is not None for r in rows):
        metrics.append(("final", ACC["local"], 100.0))
    if any(r.get("mia-shokri-acc") is not None for r in rows):
        metrics += [
            ("mia", "mia-shokri-acc", 100.0),
            ("mia_auc", "mia-shokri-auc", 100.0),
            ("mia_loss", "mia-loss-acc", 100.0),
            ("mia_loss_auc", "mia-loss-auc", 100.0),
        ]
    for tag, key, scale in metrics:
        paper = reference if tag == "final" and reference else {}
        table = [["method"] + [h for e in epsilons for h in [f"eps={e}"] + ([f"paper eps={e}"] if paper else [])]]
        for v in variants:
            cells = [v]
            for e in epsilons:
                these = [r for r in rows if r["variant"] == v and r["epsilon"] == e]
                failed = these and all(r.get("status") == "failed" for r in these)
                cells.append("failed" if failed else _fmt([r.get(key) for r in these], scale))
                if paper:
                    cells.append(f"{paper[(v, e)]:.2f}" if (v, e) in paper else "-")
            table.append(cells)
        what = {
            **heads,
            "final": "Local accuracy after the last round, %" + (" (paper: its reported number)" if paper else ""),
            "mia": "Membership inference on the published personalised prompts: Shokri MIA accuracy (chance 50)",
            "mia_auc": "Membership inference on the published personalised prompts: Shokri MIA AUC (x100, chance 50)",
            "mia_loss": "Membership inference on the published personalised prompts: loss-threshold MIA accuracy "
            "(chance 50)",
            "mia_loss_auc": "Membership inference on the published personalised prompts: loss-threshold MIA AUC "
            "(x100, chance 50)",
        }[tag]
        write_table(out, tag, f"{what}, mean ± std over seeds", table)
    return [tag for tag, _, _ in metrics]


def _bars(plt, rows: list[dict], path: Path) -> None:
    """Local and neighbor accuracy after the last round, mean over seeds, one bar pair per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(variants)), 4))
    x = np.arange(len(variants))
    for i, (key, label) in enumerate(((ACC["local"], "local classes"), (ACC["neighbor"], "neighbor classes"))):
        means = [
            100 * np.mean([r[key] for r in rows if r["variant"] == v and r.get(key) is not None] or [np.nan])
            for v in variants
        ]
        ax.bar(x + (i - 0.5) * 0.4, means, width=0.4, label=label)
    ax.set_xticks(x, variants, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("accuracy after the last round (%)")
    ax.set_ylim(0, 115)  # room for the legend above the bars
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, path, 110)
    plt.close(fig)


def audit_row(data: dict) -> dict:
    """The one-run audit of a run (results.json 'audit'), for the audited node."""
    nodes = (data.get("audit") or {}).get("nodes") or {}
    if not nodes:
        return {}
    name, node = next(iter(sorted(nodes.items())))
    return {
        "audit-node": name,
        AUDIT_METRICS["canaries"]: node["canaries"],
        AUDIT_METRICS["guesses"]: node["guesses"],
        AUDIT_METRICS["correct"]: node["correct"],
        AUDIT_METRICS["epsilon-lower"]: node["epsilon_lower"],
        "audit-accounted-mechanism": node["accounted_epsilon_audited_mechanism"],
        "audit-accounted": node["accounted_epsilon"],
        "audit-status": node["status"].split(":")[0],
    }


def write_audit(rows: list[dict], out: Path) -> None:
    """table_audit.md/.csv: per audited run, the accounted epsilon beside the audit's lower bound."""
    audited = [r for r in rows if AUDIT_METRICS["epsilon-lower"] in r]
    if not audited:
        return
    table = [["method", "target eps", "seed", "accounted eps (composed)", "accounted eps (audited mechanism)"]]
    table[0] += ["audited lower bound", "guesses", "correct", "status"]
    for r in audited:
        table.append(
            [
                r["variant"],
                r["epsilon"],
                str(r["seed"]),
                f"{r['audit-accounted']:.3f}" if r["audit-accounted"] is not None else "-",
                f"{r['audit-accounted-mechanism']:.3f}" if r["audit-accounted-mechanism"] is not None else "-",
                f"{r[AUDIT_METRICS['epsilon-lower']]:.3f}",
                str(r[AUDIT_METRICS["guesses"]]),
                str(r[AUDIT_METRICS["correct"]]),
                r["audit-status"],
            ]
        )
    head = "One-run privacy audit (privacy.audit-canaries): accounted epsilon vs the audit's 95% lower bound"
    write_table(out, "audit", head, table)


def plot_audit(rows: list[dict], out: Path) -> None:
    """audit_vs_accounted.png: the audit's lower bound against the accounted epsilon of the
    mechanism it audits; a point above the diagonal is a broken mechanism or accounting."""
    audited = [r for r in rows if r.get("audit-accounted-mechanism") is not None]
    if not audited:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for v in dict.fromkeys(r["variant"] for r in audited):
        pts = [
            (r["audit-accounted-mechanism"], r[AUDIT_METRICS["epsilon-lower"]]) for r in audited if r["variant"] == v
        ]
        ax.scatter(*zip(*pts, strict=True), label=v)
    top = max(max(r["audit-accounted-mechanism"], r[AUDIT_METRICS["epsilon-lower"]]) for r in audited) * 1.1
    ax.plot([0, top], [0, top], color="gray", ls="--", lw=1, label="lower bound = accounted")
    ax.set_xlabel("accounted epsilon (audited mechanism)")
    ax.set_ylabel("audited lower bound (95%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, out / "audit_vs_accounted.png", 110)
    plt.close(fig)


def _having(rows: list[dict], variant: str, epsilon: str, key: str) -> list[dict]:
    """The runs of a variant at an epsilon that have ``key`` (a seed that finished no round has not)."""
    return [r for r in rows if r["variant"] == variant and r["epsilon"] == epsilon and r.get(key) is not None]


def plot(rows: list[dict], out: Path, epsilons: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e for e in epsilons if e != "none"]
    if not xs:  # no epsilon axis: one bar per variant
        _bars(plt, rows, out / "accuracy_by_variant.png")
        return
    # the family's own utility (accuracies, or the VLM methods' CIDEr), each on its own axis
    utility = [(u + LAST10, f"{u} ({METRICS[u].kind.axis})", METRICS[u].kind.scale) for u in utility_columns(rows)]
    figs = [("accuracy_vs_epsilon.png", utility)]
    if any(r.get("mia-shokri-acc") is not None for r in rows):
        figs.append(
            (
                "mia_vs_epsilon.png",
                [
                    ("mia-shokri-acc", "Shokri MIA accuracy (%)", 100.0),
                    ("mia-loss-acc", "loss-threshold MIA accuracy (%)", 100.0),
                ],
            )
        )
    # 'none' asks for no target; a family with fixed noise (Reprogrammable-FL's z) still adds it
    z = next((r["noise-multiplier"] for r in rows if r["epsilon"] == "none" and r.get("noise-multiplier")), None)
    untargeted = f"no target, fixed z = {z:g}" if z else "no noise"
    for fname, keys in figs:
        if not keys:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4))
        for ax, (key, label, scale) in zip(np.atleast_1d(axes), keys, strict=True):
            for i, v in enumerate(dict.fromkeys(r["variant"] for r in rows)):
                colour = f"C{i % 10}"
                # mean over seeds, with its 95% t interval where two or more seeds ran
                found = [(float(e), stats.spread(r[key] for r in _having(rows, v, e, key))) for e in xs]
                pts = [(x, f) for x, f in found if f is not None]
                if pts:
                    ys = [scale * f.mean for _, f in pts]
                    bars = [[scale * (f.mean - f.low) if f.low is not None else 0.0 for _, f in pts]]
                    bars.append([scale * (f.high - f.mean) if f.high is not None else 0.0 for _, f in pts])
                    ax.errorbar([x for x, _ in pts], ys, yerr=bars, marker="o", color=colour, label=v, capsize=3)
                clean = [r[key] for r in _having(rows, v, "none", key)]
                if clean:  # a method without a target (zero-shot, CoOp) is its dotted line alone, labelled
                    ax.axhline(
                        scale * np.mean(clean), color=colour, ls=":", lw=1, label=None if pts else f"{v} ({untargeted})"
                    )
            if "mia" in key:
                ax.axhline(50, color="gray", ls="--", lw=1, label="chance (50%)")
            ax.set_xscale("log")
            ticks = sorted(float(e) for e in xs)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel(f"target epsilon (dotted: the same method, {untargeted})")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("mean over seeds; bars: 95% Student-t interval over seeds", fontsize=9)
        fig.tight_layout()
        atomic_savefig(fig, out / fname, 110)
        plt.close(fig)
