"""Progress of long work (pretraining the embedded models, encoding images, sweeps, the
leaderboard): a tqdm bar with its rate and time left on a terminal, nothing in a log. CI logs and
``flwr run --stream`` are not terminals; there the work's own log lines, a few per task, say how
far it got (a sweep's name the time left). ``FEDVLM_PROGRESS=1`` forces the bars, ``0`` hides them."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

T = TypeVar("T")


def interactive() -> bool:
    """Whether to draw bars: a terminal on stderr outside CI, unless FEDVLM_PROGRESS decides."""
    chosen = os.environ.get("FEDVLM_PROGRESS", "").strip().lower()
    if chosen:
        return chosen not in ("0", "false", "no", "off")
    return sys.stderr.isatty() and not os.environ.get("CI")


def bar(total: int, desc: str, unit: str = "it") -> tqdm:
    """A bar of ``total`` units (``update`` it); an inert one where ``interactive`` says no."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not interactive(), leave=False, dynamic_ncols=True)


def time_left(done: int, total: int, seconds: float) -> str:
    """'about 12 min left' from the mean time per finished unit (for log lines, where no bar is)."""
    if done <= 0 or done >= total:
        return ""
    left = seconds / done * (total - done)
    return f"about {left / 60:.0f} min left" if left >= 90 else f"about {left:.0f} s left"


def each(items: Iterable[T], desc: str, unit: str = "step") -> Iterator[T]:
    """``items`` under a bar (see ``bar``). While a bar is drawn, log lines are written above it
    (a sweep logs each run) rather than through it."""
    shown = interactive()
    with logging_redirect_tqdm() if shown else contextlib.nullcontext():
        yield from tqdm(items, desc=desc, unit=unit, disable=not shown, leave=False, dynamic_ncols=True)
