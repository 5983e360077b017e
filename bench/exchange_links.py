"""Benchmark: where a deployed exchange's time goes, link by link, on every node.

Runs the loopback deployment of ``bench/deployment_speed.py`` (TLS, node authentication, the
gateway, SQLite state, a warm worker per organisation) with ``bench/stamped_logs`` on every
program's PYTHONPATH, so that each log line carries its time, and lays each node's logs on one
time line. An exchange at a node, from the logs of its SuperNode, SuperExec (its ClientApps) and
worker:

1. received -> ClientApp started: the SuperNode stores the message, its SuperExec's look for a task
   returns, the fork server forks the ClientApp;
2. ClientApp started -> worker served: the ClientApp pulls its input from the SuperNode, checks the
   pin and the signature, loads the app and forwards the message to the node's worker, which
   computes (training, a secure-aggregation stage);
3. worker served -> reply sending: the reply back to the SuperNode, and its wait for it;
4. reply sending -> sent: the SuperNode's push through the gateway to the SuperLink;
5. sent -> next received: the other nodes, the ServerApp's next messages, the SuperLink's wake of
   the node's held pull.

Each node's first two exchanges (the connection's hello, the first training's loads) are left
out. Prints and writes (``--out``) the median and mean of each link over every node and exchange,
with the deployment's own figures (rounds, a secure round's stages, CPU per program).

    python bench/exchange_links.py --supernodes 4 --rounds 5 \\
        --run-config "secure-aggregation.enabled=true replies.max-norm=100.0"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from datetime import datetime
from pathlib import Path

from bench.deployment_speed import deployed, summary
from bench.measure import bench_report

STAMPS = Path(__file__).resolve().parent / "stamped_logs"
# (log, pattern): the events of an exchange at a node, in the order they happen
EVENTS = {
    "received": ("{org}.log", "Received successfully"),
    "started": ("{org}-exec.log", "Start `flwr-clientapp` process"),
    "served": ("{org}-worker.log", "served "),
    "sending": ("{org}.log", "Sending: "),
    "sent": ("{org}.log", "Sent successfully"),
}
LINKS = (
    ("received", "started", "received -> ClientApp started"),
    ("started", "served", "ClientApp started -> worker served"),
    ("served", "sending", "worker served -> reply sending"),
    ("sending", "sent", "reply sending -> sent"),
    ("sent", "received", "sent -> next received"),
)
SKIPPED = 2  # each node's first exchanges: its hello and the first training's loads


def events(logs: Path, org: str) -> list[tuple[float, str]]:
    """A node's events in time order: (seconds, name)."""
    found = []
    for name, (log, text) in EVENTS.items():
        for line in (logs / log.format(org=org)).read_text(errors="replace").splitlines():
            m = re.match(r"@(\d\d:\d\d:\d\d\.\d{3}) ", line)
            if m and text in line:
                found.append((datetime.strptime(m.group(1), "%H:%M:%S.%f").timestamp(), name))
    return sorted(found)


def link_times(timeline: list[tuple[float, str]]) -> dict[str, list[float]]:
    """Each link's seconds, walking the node's exchanges one after another (a node handles one
    message at a time): an exchange runs from one "received" to the next."""
    times: dict[str, list[float]] = {name: [] for _, _, name in LINKS}
    starts = [i for i, (_, e) in enumerate(timeline) if e == "received"]
    for first, nxt in list(zip(starts, starts[1:], strict=False))[SKIPPED:]:
        at = {"received": timeline[first][0]}
        for t, e in timeline[first + 1 : nxt]:
            at.setdefault(e, t)
        at["next"] = timeline[nxt][0]
        for a, b, name in LINKS:
            end = at.get("next" if b == "received" else b)
            if a in at and end is not None and end >= at[a]:
                times[name].append(end - at[a])
    return times


def _ms(seconds: float) -> int:
    return round(1000 * seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--supernodes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--run-config", default="")
    p.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    p.add_argument("--out", default="bench_exchange_links.json")
    args = p.parse_args()
    args.method, args.round_timeout = "promptfl", 600.0
    args.run_config = f"num-server-rounds={args.rounds} {args.run_config}".strip()
    os.environ["FEDVLM_CACHE"] = args.cache_dir
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STAMPS), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="fedvlm-bench-links-") as tmp:
        run = deployed(args, Path(tmp), warm=True)
        logs = Path(tmp) / "fed" / "logs"
        times: dict[str, list[float]] = {name: [] for _, _, name in LINKS}
        for i in range(args.supernodes):
            for name, got in link_times(events(logs, f"org-{i}")).items():
                times[name] += got
    links = {
        name: {"median_ms": _ms(statistics.median(v)), "mean_ms": _ms(statistics.mean(v)), "n": len(v)}
        for name, v in times.items()
        if v
    }
    for name, row in links.items():
        print(f"{name:38s} median {row['median_ms']:5d} ms  mean {row['mean_ms']:5d} ms  n {row['n']}")
    report = bench_report({"args": vars(args), "links": links, "run": summary(run, args.round_timeout)})
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
