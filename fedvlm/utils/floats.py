"""Denormal floats flushed to zero in the processes that compute a run, and what a process
computes with, as its records say it.

Why: x86 CPUs compute on denormal (subnormal) floats, those below 1.2e-38 in float32, through a
slow microcode path. On an Intel Xeon a pFedMoAP DP-SGD run's rounds grew from 18 to 128 s as
its state decayed into them; flushed, they stayed at 27-29 s (docs/results/experiments.md,
pFedMoAP's section; ``bench/denormals.py`` measures the kernels). Flushing maps those values to
zero, so results change in their last bits: ``FEDVLM_FLUSH_DENORMALS=0`` in a process's
environment keeps them, as every run made before this did.

The mode is a property of each CPU thread, inherited by a thread when it is started: it is set
where a process starts computing (a node's message, the ServerApp's run), before the backbone
loads and the compute threads exist. Pretraining the embedded CLIP gives the same weights in both
modes (``bench/denormals.py --pretrain``), so a cache does not depend on which process filled
it. A process whose compute threads were started earlier keeps their mode on those threads:
``denormals()`` probes what the threads actually do, and every node's handshake and the run's
record say it (``compute_report``).

Why every privacy guarantee still holds: flushing only replaces a value of magnitude below
2^-126 by zero. A clipped per-record update can only shrink, so its norm stays within the clip;
the accountant's noise scale is unchanged; a Gaussian draw lands below 2^-126 with probability
about 1e-38, which changes the mechanism's output distribution by far less than any delta the
planner accepts, wherever the noise is drawn; secure aggregation masks integers, which it leaves alone.
"""

from __future__ import annotations

import os

import torch

ENV = "FEDVLM_FLUSH_DENORMALS"
_PROBE = 1 << 22  # elements: large enough that every compute thread gets a part of it
_DENORMAL_BITS = 1 << 20  # a float32 denormal (1.5e-39) as its bits: made without float arithmetic


def flush_denormals() -> None:
    """Set this thread's mode, and so that of the compute threads it starts, from ``ENV``."""
    torch.set_flush_denormal(os.environ.get(ENV, "1") != "0")


def denormals() -> str:
    """What this process's compute threads do with denormals: 'flushed', 'kept', or 'flushed on
    part of the threads' (threads started before the mode was set)."""
    # the probe is written and counted as integers: converting 1e-39 to a float on a flushing
    # thread gives zero, and a flushing thread's comparisons see a denormal as zero
    probe = torch.full((_PROBE,), _DENORMAL_BITS, dtype=torch.int32).view(torch.float32)
    kept = int(((probe * 1.0).view(torch.int32) != 0).sum())
    if kept == 0:
        return "denormals flushed"
    if kept == _PROBE:
        return "denormals kept"
    return f"denormals flushed on part of the threads ({kept / _PROBE:.0%} of a probe kept)"


def compute_report() -> str:
    """How this process computes, as a node's handshake and the run's record say it: the threads,
    the niceness, and the denormal mode (each changes either the seconds or the last bits)."""
    return f"{torch.get_num_threads()} threads, nice {os.getpriority(os.PRIO_PROCESS, 0)}, {denormals()}"
