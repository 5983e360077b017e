"""Two rows of a sweep folder, one figure, their difference paired by seed with its 95% interval:
what a claim that one method beats another rests on, for any pair the board or a protocol did not
name as a headline.

    python -m fedvlm.experiments.compare docs/results/leaderboard-runs/prompt promptfl@8 dpfpl-r8@8 neighbor-acc

A row is ``variant@epsilon`` ('none' for no noise); the figure is a utility's mean of the last 10
rounds (``local-acc``: its ``-last10-mean`` column), with ``--final`` its last round's (the figure
pFedMoAP's, FedRand's and Reprogrammable-FL's headlines read), with ``--round N`` its figure after
round N (a longer run read at a shorter protocol's last round, on the same runs), or any column of
the folder's summary.csv.
Only finished runs count; the seeds both rows ran are paired (Welch's interval otherwise,
``experiments.stats.difference``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedvlm.experiments import stats
from fedvlm.experiments.sweep_report import LAST10, read_summary, shown_scale
from fedvlm.metrics import METRICS
from fedvlm.utils.files import UnreadableFile, read_results


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


def at_round(folder: Path, row: tuple[str, str], seeds, figure: str, n: int) -> dict[int, float | None]:
    """``figure`` after round ``n`` of each of ``row``'s runs (``seeds``), from their results.json.
    A run that never reached round ``n``, or did not evaluate it (``evaluate-every``), is named."""
    from fedvlm.experiments.sweep import DAMAGED, run_name  # the sweep's folder layout (it loads torch)

    out = {}
    for seed in seeds:
        run = folder / "runs" / run_name(*row, seed)
        rounds = {r.get("round"): r for r in read_results(run, DAMAGED)["rounds"]}
        if n not in rounds:
            raise ValueError(f"{run} has {len(rounds)} rounds, no round {n}: name a round it ran")
        if not stats.finite([rounds[n]["metrics"].get(figure)]):
            raise ValueError(f"{run}'s round {n} has no {figure} (not evaluated that round): name one it evaluated")
        out[seed] = rounds[n]["metrics"][figure]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a sweep's --out folder (it holds summary.csv)")
    p.add_argument("a", type=_row, help="variant@epsilon")
    p.add_argument("b", type=_row, help="variant@epsilon, subtracted from a")
    p.add_argument("figure", help="local-acc, neighbor-acc, server-cider, ... or any summary.csv column")
    p.add_argument("--final", action="store_true", help="the figure's last round, not its mean of the last 10")
    p.add_argument("--round", type=int, help="the figure after this round, read from each run's results.json")
    p.add_argument("--b-folder", type=Path, help="b's sweep folder where it is not a's (a board's dp-compute rows)")
    args = p.parse_args(argv)
    for flag, given in (("--final", args.final), ("--round", args.round)):
        if given and args.figure not in METRICS:
            p.error(f"{flag}: {args.figure} is a column, not a figure of the rounds: name a figure, or drop {flag}")
    if args.round is not None and (args.final or args.round < 1):
        p.error("--round N: a round from 1 on, without --final (the last round is --final)")
    column = args.figure + LAST10 if args.figure in METRICS and not args.final else args.figure
    label = column if args.round is None else f"{args.figure} after round {args.round}"
    got = []
    for row, folder in ((args.a, args.folder), (args.b, args.b_folder or args.folder)):
        rows = read_summary(folder / "summary.csv")
        if rows and column not in rows[0]:
            figures = ", ".join(c.removesuffix(LAST10) for c in rows[0] if c.endswith(LAST10))
            p.error(f"{args.figure}: not in {folder / 'summary.csv'}: its figures are {figures}, or name a column")
        got.append(by_seed(rows, row, column))
        if args.round is not None:
            try:
                got[-1] = at_round(folder, row, list(got[-1]), args.figure, args.round)
            except (ValueError, UnreadableFile) as err:
                p.error(f"--round {args.round}: {err}")
        if not stats.finite(got[-1].values()):
            p.error(f"{row[0]}@{row[1]}: no finished run with a {label} in {folder / 'summary.csv'}")
    a, b = got
    d = stats.difference(a, b)
    assert d is not None  # both rows have a finite figure
    paired = "paired by seed" if stats.paired(a, b) else "unpaired (Welch)"
    print(
        f"{'@'.join(args.a)} - {'@'.join(args.b)}, {label}: {d.interval(shown_scale(column))} "
        f"(95% t interval, {paired}, {d.n} seeds: {sorted(stats.finite_keys(a))} and {sorted(stats.finite_keys(b))})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
