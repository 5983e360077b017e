"""Redraw the pictures of run or sweep folders from what they hold.

    python -m fedvlm.plots ~/fedvlm-runs/<run folder>          # curves, privacy.png, partition.png
    python -m fedvlm.plots ~/fedvlm-sweeps/embedded            # a sweep's plots against epsilon

A run folder is one with results.json (its ``run.plots`` is updated to what was drawn); a sweep
folder one with summary.csv (``python -m fedvlm.experiments.sweep --out``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fedvlm.plots import redraw_run
from fedvlm.utils.files import RESULTS, UnreadableFile


def redraw_sweep(folder: Path) -> list[str]:
    """A sweep's plots from its summary.csv (the rows it wrote after every run)."""
    from fedvlm.experiments.attack_report import plot_attacks
    from fedvlm.experiments.sweep_report import plot, plot_audit, read_summary

    rows = read_summary(folder / "summary.csv")
    done = [r for r in rows if r["status"] != "failed"]
    before = {p.name: p.stat().st_mtime for p in folder.glob("*.png")}
    plot(done, folder, list(dict.fromkeys(r["epsilon"] for r in rows)))
    plot_audit(done, folder)
    plot_attacks(done, folder)
    return sorted(p.name for p in folder.glob("*.png") if before.get(p.name) != p.stat().st_mtime)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, metavar="FOLDER", help="a run folder or a sweep folder")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    status = 0
    for folder in args.folders:
        folder = folder.expanduser().resolve()
        try:
            status = max(status, _redraw(folder))
        except UnreadableFile as err:  # a damaged results.json: named, left as it is
            print(f"{folder}: {err}", file=sys.stderr)
            status = 2
        except OSError as err:  # a folder it may not write in: what could not be written, and the fix
            print(
                f"{folder}: cannot write its pictures ({err}); make it writable, or copy it somewhere that is",
                file=sys.stderr,
            )
            status = 2
    return status


def _redraw(folder: Path) -> int:
    if (folder / RESULTS).exists():
        for name, shows in redraw_run(folder).items():
            print(f"{folder / name}: {', '.join(shows)}")
    elif (folder / "summary.csv").exists():
        for name in redraw_sweep(folder):
            print(folder / name)
    else:
        print(f"{folder}: neither a run folder ({RESULTS}) nor a sweep folder (summary.csv)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
