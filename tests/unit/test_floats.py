"""The denormal mode of a fresh process (``utils.floats``): flushed unless its environment says
to keep them, on every compute thread, as the probe reports; and a mode set after the compute
threads started is reported as partial, not as flushed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fedvlm.utils.floats import ENV

FRESH = """
import torch
from fedvlm.utils.floats import compute_report, flush_denormals
{before}
flush_denormals()
x = torch.full((1 << 22,), 1 << 20, dtype=torch.int32).view(torch.float32)  # denormals, from their bits
print(compute_report(), int(((x * 0.5).view(torch.int32) != 0).sum()))
"""


def _fresh(before: str = "", **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", FRESH.format(before=before)],
        env={**clean, "OMP_NUM_THREADS": "2", **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return " ".join(out[:-1]), int(out[-1])


@pytest.mark.parametrize(
    "value, said", [(None, "denormals flushed"), ("1", "denormals flushed"), ("0", "denormals kept")]
)
def test_a_fresh_process_flushes_unless_told_to_keep(value, said):
    report, left = _fresh(**({ENV: value} if value is not None else {}))
    assert report == f"2 threads, nice {os.getpriority(os.PRIO_PROCESS, 0)}, {said}"
    # the report is the arithmetic's truth: a denormal product survives only where they are kept
    assert left == (0 if said.endswith("flushed") else 1 << 22)


def test_threads_started_before_the_mode_are_reported_not_hidden():
    # a parallel kernel before the call starts the compute threads in the old mode: they keep it
    report, left = _fresh(before="(torch.ones(1 << 22) * 2).sum()")
    assert "flushed on part of the threads" in report and 0 < left < 1 << 22
