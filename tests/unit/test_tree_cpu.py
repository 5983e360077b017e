"""The per-program CPU profile (``utils.processes.TreeCpu``) the benches measure the message path
with: a child that has ended is counted once, in its parent's children's time
(also one that lived and died between two samples); a process's own time is its own; the zero
can be moved past a start-up."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from bench.measure import TreeCpu
from fedvlm.utils.processes import kill_tree

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
PARENT = (
    "import subprocess, sys, time\n"
    "time.sleep(1.0)\n"  # the profile's zero is taken before any of this
    + BURN.format(s=0.4)
    + "subprocess.run([sys.executable, '-c', {child!r}])\n"  # lives and dies between samples
    "time.sleep(60)  # {marker}\n"
)


def test_cpu_seconds_per_program_count_a_reaped_child_once_in_its_parent():
    marker = uuid.uuid4().hex
    code = PARENT.format(child=BURN.format(s=0.6), marker=marker)
    parent = subprocess.Popen([sys.executable, "-c", code])
    started = time.monotonic()
    try:
        with TreeCpu(marker, start=lambda: time.monotonic() - started > 0.5, interval=0.1) as cpu:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sum(r["children"] for r in cpu.by_program().values()) < 0.55:
                time.sleep(0.2)
            assert cpu.alive == {parent.pid} and cpu.zero  # the child is gone; the zero was moved
            row = next(iter(cpu.by_program().values()))
    finally:
        kill_tree(parent.pid)
    assert row["processes"] == 1  # the child was never sampled: it lived inside one interval
    assert 0.55 <= row["children"] <= 0.9, row  # the child's 0.6 s, once
    assert 0.35 <= row["own"] <= 0.7, row  # the parent's 0.4 s (and its start-up after the zero)
    assert abs(row["total"] - row["own"] - row["children"]) < 0.02
