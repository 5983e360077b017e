"""Two rows of a sweep folder, one figure, their difference paired by seed with its 95% interval:
what a claim that one method beats another rests on, for any pair the board or a protocol did not
name as a headline.

    python -m fedvlm.experiments.compare docs/results/leaderboard-runs/prompt promptfl@8 dpfpl-r8@8 neighbor-acc

A row is ``variant@epsilon`` ('none' for no noise); the figure is a utility's mean of the last 10
rounds (``local-acc``: its ``-last10-mean`` column), with ``--final`` its last round's (the figure
pFedMoAP's, FedRand's and Reprogrammable-FL's headlines read), or any column of the folder's summary.csv.
Only finished runs count; the seeds both rows ran are paired (Welch's interval otherwise,
``experiments.stats.difference``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedvlm.experiments import stats
from fedvlm.experiments.sweep_report import LAST10, read_summary, shown_scale
from fedvlm.metrics import METRICS


def _row(text: str) -> tuple[str, str]:
    variant, at, epsilon = text.rpartition("@")
    if not at or not variant or not epsilon:
        raise argparse.ArgumentTypeError(f"{text!r}: a row is variant@epsilon, e.g. promptfl@8 or coop@none")
    return variant, epsilon


def by_seed(rows: list[dict], row: tuple[str, str], column: str) -> dict[int, float | None]:
    """The finished runs of ``row``: seed -> its ``column``."""
    variant, epsilon = row
    mine = [r for r in rows if r["variant"] == variant and r["epsilon"] == epsilon and r["status"] == "finished"]
    return {int(r["seed"]): r.get(column) for r in mine}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a sweep's --out folder (it holds summary.csv)")
    p.add_argument("a", type=_row, help="variant@epsilon")
    p.add_argument("b", type=_row, help="variant@epsilon, subtracted from a")
    p.add_argument("figure", help="local-acc, neighbor-acc, server-cider, ... or any summary.csv column")
    p.add_argument("--final", action="store_true", help="the figure's last round, not its mean of the last 10")
    p.add_argument("--b-folder", type=Path, help="b's sweep folder where it is not a's (a board's dp-compute rows)")
    args = p.parse_args(argv)
    if args.final and args.figure not in METRICS:
        p.error(f"--final: {args.figure} is a column, not a figure of the rounds: name a figure, or drop --final")
    column = args.figure + LAST10 if args.figure in METRICS and not args.final else args.figure
    got = []
    for row, folder in ((args.a, args.folder), (args.b, args.b_folder or args.folder)):
        rows = read_summary(folder / "summary.csv")
        if rows and column not in rows[0]:
            figures = ", ".join(c.removesuffix(LAST10) for c in rows[0] if c.endswith(LAST10))
            p.error(f"{args.figure}: not in {folder / 'summary.csv'}: its figures are {figures}, or name a column")
        got.append(by_seed(rows, row, column))
        if not stats.finite(got[-1].values()):
            p.error(f"{row[0]}@{row[1]}: no finished run with a {column} in {folder / 'summary.csv'}")
    a, b = got
    d = stats.difference(a, b)
    assert d is not None  # both rows have a finite figure
    paired = "paired by seed" if set(a) == set(b) else "unpaired (Welch)"
    print(
        f"{'@'.join(args.a)} - {'@'.join(args.b)}, {column}: {d.interval(shown_scale(column))} "
        f"(95% t interval, {paired}, {d.n} seeds: {sorted(a)} and {sorted(b)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
