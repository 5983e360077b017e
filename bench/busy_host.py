"""Benchmark: a simulated round on a busy host. The same ``flwr run`` (10 clients, the embedded
default) with Flower's and Ray's defaults for its clients (two OpenMP threads each, nice 15) and
with the project's (``utils.processes.ClientShare``: one thread where cores are few, the host's
niceness), on a quiet machine and beside ``--busy`` processes that spin at nice 0, side by side.

What the clients ran with is what each said in its handshake (its torch threads and niceness, the
``compute`` of results.json's nodes), beside the load. A round's seconds are the run's own (results.json),
after its first round.

    python bench/busy_host.py --rounds 3 --busy 4 --out docs/results/busy_host.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from round_overhead import run_flwr

from bench.measure import bench_report
from fedvlm.utils.processes import DEFAULT_SHARE, ClientShare, kill_tree

SHARES = {"flower-defaults": ClientShare(threads=2, niceness=15), "project-defaults": DEFAULT_SHARE}


class LoadWatch:
    """The machine's 1-minute load, twice a second, while a run lasts."""

    def __init__(self) -> None:
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def case(share: ClientShare, busy: int, rounds: int, cache: str) -> dict:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp, LoadWatch() as watch:
            data, wall = run_flwr("promptfl", rounds, Path(tmp), cache, share=share)
    finally:
        for s in spinners:
            kill_tree(s.pid)
    seconds = [r["seconds"] for r in data["rounds"][1:]]
    return {
        **share.record(),
        "busy_processes": busy,
        "load_1min_max": round(max(watch.loads, default=0.0), 2),
        "clients_ran_with": sorted({node["info"].get("compute", "?") for node in data["run"]["nodes"]}),
        "round_s": round(sum(seconds) / len(seconds), 2),
        "rounds_timed": f"2-{rounds}",
        "run_wall_s": round(wall, 1),
        "local_acc_last": data["rounds"][-1]["metrics"]["local-acc"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=4, help="spinning processes beside the busy runs")
    p.add_argument("--out", type=Path, default=Path("busy_host.json"))
    p.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds: at least 2 (the first round's set-up is not timed)")
    rows = []
    for busy in (0, args.busy):
        for name, share in SHARES.items():
            row = {"clients": name, **case(share, busy, args.rounds, args.cache_dir)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    quiet = {r["clients"]: r["round_s"] for r in rows if not r["busy_processes"]}
    ratios = {r["clients"]: round(r["round_s"] / quiet[r["clients"]], 2) for r in rows if r["busy_processes"]}
    summary = {"busy_over_quiet_round_s": ratios}
    print(json.dumps(summary))
    command = "python bench/busy_host.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps(bench_report({"command": command, "rows": rows, **summary}), indent=2) + "\n")


if __name__ == "__main__":
    main()
