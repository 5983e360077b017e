"""The pictures of a run, drawn when it ends from what it recorded and redrawn from its folder
(``python -m fedvlm.plots RUN_DIR``): the curves of its declared round figures (``curves``), its
privacy ledger against the target, the budget, the audit and the attacks (``privacy``), and,
drawn only by that command, a simulation's split of the records over its nodes
(``partition``). A sweep's folder gets its accuracy-, attack- and audit-against-epsilon plots
(``experiments.sweep_report``)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def draw_run(data: dict, out_dir: Path, with_data: bool = False) -> dict[str, list[str]]:
    """Every picture of a run (results.json's content ``data``) into ``out_dir``: file name ->
    what it shows. The ServerApp draws only what the run recorded (curves, privacy); the split of
    a simulation's records (``with_data``) needs every node's data loaded, which only the
    researcher's own command does (``python -m fedvlm.plots``), never a ServerApp. One picture
    that cannot be drawn (a dataset the plotting machine lacks) is logged and left out; the others
    are still drawn."""
    import matplotlib

    matplotlib.use("Agg")
    from fedvlm.plots.curves import draw_curves
    from fedvlm.plots.partition import draw_partition
    from fedvlm.plots.privacy import draw_privacy

    drawn: dict[str, list[str]] = {}
    for draw in (draw_curves, draw_privacy, *((draw_partition,) if with_data else ())):
        try:
            drawn.update(draw(data, out_dir))
        except Exception as err:  # noqa: BLE001 - one picture must not cost the others or the results
            log.warning("could not draw %s: %s: %s", draw.__name__.removeprefix("draw_"), type(err).__name__, err)
            drawn[f"{draw.__name__.removeprefix('draw_')}: not drawn"] = [f"{type(err).__name__}: {str(err)[:300]}"]
    return drawn


def redraw_run(folder: Path) -> dict[str, list[str]]:
    """A run folder's pictures from what it holds now (an attack report made after the run, say),
    with a simulation's split of its records; a run that has ended gets its ``run.plots`` updated
    to what was drawn."""
    from fedvlm.utils.files import RESULTS, atomic_write_json, read_results

    data = read_results(folder, "restore it from a backup; the pictures are drawn from it")
    drawn = draw_run(data, folder, with_data=True)
    if data["run"].get("status") != "running":  # a running run rewrites results.json itself
        data["run"]["plots"] = drawn
        atomic_write_json(data, (folder / RESULTS).resolve())  # a symlinked results.json stays one
    return drawn
