"""Benchmark: a deployment against the same run in simulation, side by side on one machine.

Runs the embedded default (``--method``, ``--rounds``) several ways (``--modes``),
``--repeats`` times, alternated:

- ``simulation``: ``flwr run`` with ``--supernodes`` virtual nodes (Ray);
- ``cold``: a real SuperLink (TLS, node authentication) and ``--supernodes`` SuperNodes on
  loopback (``deploy.local_federation``), each message run in its ClientApp process, which
  loads torch, the model and the data;
- ``warm``: the same with a warm node worker beside each SuperNode
  (``python -m fedvlm.deploy.node_worker``): the deployment as docs/deployment.md sets it up;
- ``warm-memory``: warm, with the SuperLink's state in its memory (no ``--database``): what
  Flower's SQLite state costs per round (every pull and push is a SQLAlchemy transaction in the
  SuperLink's one process);
- ``warm-spawn``: warm, with each ClientApp process started from scratch, as Flower starts it,
  instead of forked from the SuperExec's fork server (``deploy.clientapp_forks``);
- ``warm-flower-waits``: warm, with the SuperNodes and SuperExecs looking for work as often as
  Flower's own do (``FLOWER_WAITS``: 3 s between empty pulls, 0.5 s between looks for a reply,
  1 s between looks for a task) instead of 0.5 s, 0.1 s and 0.2 s.

Prints seconds per round (round 1 apart: it loads models and features everywhere; a round's
time runs from its start to the next's, and the last round's includes its evaluation, which goes
alone), their mean and median over every run of a mode, the ratio of each deployment to the
simulation, a whole run's time (``flwr run`` to its end, the federation already up) and its
ratio, lost replies, rounds that waited out round-timeout, the federation's peak memory per
program, and its CPU seconds per program and later round (``utils.processes.TreeCpu``: by CPU
time, so a busy machine does not distort it; the profile every change to the message path is
measured with); writes all of it as JSON.

    python bench/deployment_speed.py --supernodes 4 --rounds 4
    python bench/deployment_speed.py --supernodes 20 --rounds 3 --modes warm
    python bench/deployment_speed.py --modes warm --run-config "secure-aggregation.enabled=true replies.max-norm=100.0"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from bench.measure import TreeCpu, bench_report
from fedvlm.deploy.local_federation import FLOWER_WAITS, OUR_WAITS, LocalFederation, NodeWaits
from fedvlm.server_app.results import ROUNDS_CSV
from fedvlm.utils.processes import TreeMemory, flwr_env, flwr_run, kill_tree, pids_matching

ROOT = Path(__file__).resolve().parents[1]


def _rounds(results: Path) -> list[dict]:
    return json.loads(results.read_text())["rounds"]


def simulation(args, work: Path) -> dict:
    home = work / "flwr-home"
    config = f"{args.run_config} output-dir='{work / 'runs'}' run-name='sim'"
    t0 = time.time()
    with TreeMemory(str(home), 1.0) as mem, _profile(str(home), work / "runs" / "sim") as cpu:
        try:
            proc = flwr_run(flwr_env(home), config, supernodes=args.supernodes, timeout=3600)
            by_program = cpu.by_program()
        finally:
            for pid in pids_matching(str(home)):
                kill_tree(pid)
    if proc.returncode:
        raise SystemExit(f"flwr run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rounds = _rounds(work / "runs" / "sim" / "results.json")
    return {"rounds": rounds, "wall_s": time.time() - t0, "memory": mem, "cpu": by_program}


def _profile(fragment: str, run_dir: Path) -> TreeCpu:
    """CPU seconds per program from the end of the run's first round (its set-up: models, features)."""
    csv = run_dir / ROUNDS_CSV

    def first_round_done() -> bool:
        return csv.exists() and len(csv.read_text().splitlines()) > 1

    return TreeCpu(fragment, start=first_round_done)


def deployed(
    args, work: Path, warm: bool, waits: NodeWaits = OUR_WAITS, fork: bool = True, database: bool = True
) -> dict:
    names = [f"org-{i}" for i in range(args.supernodes)]
    configs = {n: f"partition-id={i} num-partitions={args.supernodes}" for i, n in enumerate(names)}
    config = f"{args.run_config} output-dir='{work / 'runs'}' run-name='dep' min-nodes={args.supernodes}"
    fed_ = LocalFederation(
        work / "fed", names, configs, workers=names if warm else (), waits=waits, fork=fork, database=database
    )
    with fed_ as fed, TreeMemory(str(fed.dir), 1.0) as mem, _profile(str(fed.dir), work / "runs" / "dep") as cpu:
        _wait_online(fed, args.supernodes)
        seen = len(fed.log_text("gateway"))
        t0 = time.time()
        proc = fed.run_app(config, timeout=3600)
        wall = time.time() - t0
        lost = fed.lost_replies()
        by_program = cpu.by_program()
        calls = fleet_calls(fed.log_text("gateway")[seen:], args.supernodes * args.rounds)
    results = work / "runs" / "dep" / "results.json"
    # flwr run exits 0 when the ServerApp fails
    if proc.returncode or not results.exists() or len(_rounds(results)) < args.rounds:
        run = json.loads(results.read_text())["run"] if results.exists() else {}
        raise SystemExit(
            f"the deployed run failed ({run.get('status')}: {run.get('note')}; "
            f"excluded: {run.get('excluded_nodes')}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    return {"rounds": _rounds(results), "wall_s": wall, "lost": lost, "memory": mem, "cpu": by_program, "calls": calls}


def fleet_calls(gateway_log: str, node_rounds: int) -> dict[str, float]:
    """Fleet calls per node and round, by kind, from the gateway's log of a whole run (its hello and
    first round included); ``pull-object not stored yet``: the pulls answered 'ask again'."""
    calls: dict[str, float] = {}
    for m in re.finditer(r" ([a-z-]+) (\d{3}) in (\d+) out (\d+) ", gateway_log):
        calls[m.group(1)] = calls.get(m.group(1), 0) + 1
        if m.group(1) == "pull-object" and int(m.group(4)) < 16:  # object_found, not available: no content
            calls["pull-object not stored yet"] = calls.get("pull-object not stored yet", 0) + 1
    per = {k: round(v / node_rounds, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}
    return {**per, "all": round(sum(v for k, v in per.items() if "not stored" not in k), 2)}


def _wait_online(fed: LocalFederation, n: int, timeout: float = 600) -> None:
    deadline, online, why = time.time() + timeout, 0, ""
    while time.time() < deadline:
        proc = fed.flwr("supernode", "list", "loopback", "--format", "json", timeout=60)
        nodes = json.loads(proc.stdout)["nodes"] if proc.returncode == 0 else []
        why = "" if proc.returncode == 0 else f"; `flwr supernode list` said: {proc.stderr.strip()[-300:]}"
        online = sum(node["status"] == "online" for node in nodes)
        if online >= n:
            return
        time.sleep(1)
    errors = [  # the bench's folder goes with it: what the programs' logs said, before it does
        f"{log.stem}: {line.strip()[:200]}"
        for log in sorted((fed.dir / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "ERROR" in line or "Error" in line
    ]
    raise SystemExit(
        f"{online} of {n} SuperNodes online after {timeout:.0f} s{why}; the programs' logs said: "
        + ("; ".join(errors[:5]) or "no error (too slow to start: the machine's load, or its memory)")
    )


def summary(run: dict, round_timeout: float) -> dict:
    later = [r["seconds"] for r in run["rounds"][1:]]
    mem = run["memory"]
    return {
        "round_1_s": run["rounds"][0]["seconds"],
        "later_rounds_s": later,
        "later_round_mean_s": statistics.mean(later) if later else float("nan"),
        "rounds_waiting_out_round_timeout": sum(r["seconds"] >= round_timeout for r in run["rounds"]),
        "asked_again": sum(len(r.get("asked_again", [])) for r in run["rounds"]),
        "missing": sum(len(r.get("missing", [])) for r in run["rounds"]),
        "lost_in_transit": run.get("lost", 0),
        "wall_s": run["wall_s"],
        "peak_pss_mib": round(mem.peak_pss_mib),
        "peak_by_program": mem.peak_by_program,
        # CPU seconds per program and later round (TreeCpu: own, children it reaped, total)
        "cpu_s_per_round": {
            name: {k: round(v / max(len(later), 1), 3) for k, v in row.items() if k != "processes"}
            for name, row in run["cpu"].items()
        },
        "cpu_s_per_round_total": round(sum(r["total"] for r in run["cpu"].values()) / max(len(later), 1), 3),
        "fleet_calls_per_node_round": run.get("calls", {}),  # a deployment's only
        # a secure round's later stages, each from sending its messages to taking its replies
        "secure_stage_s": _stage_means([r.get("secure_aggregation") or {} for r in run["rounds"][1:]]),
    }


def _stage_means(protocols: list[dict]) -> dict[str, float]:
    stages = [p["stage_seconds"] for p in protocols if p.get("stage_seconds")]
    names = sorted({name for s in stages for name in s})
    return {name: round(statistics.mean(s.get(name, 0.0) for s in stages), 3) for name in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--supernodes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--method", default="promptfl")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default="simulation,warm,warm-memory,warm-spawn,warm-flower-waits,cold")
    p.add_argument("--cache-dir", default=os.environ.get("FEDVLM_CACHE", str(Path.home() / ".cache" / "fedvlm")))
    p.add_argument("--round-timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench_deployment_speed.json")
    p.add_argument(
        "--run-config",
        dest="extra",
        default="",
        help='more run-config keys, e.g. "secure-aggregation.enabled=true replies.max-norm=100.0"',
    )
    args = p.parse_args()
    args.run_config = (
        f"method='{args.method}' num-server-rounds={args.rounds} cache-dir='{args.cache_dir}' "
        f"round-timeout={args.round_timeout} {args.extra}"
    ).strip()
    modes = {
        "simulation": lambda w: simulation(args, w),
        "cold": lambda w: deployed(args, w, warm=False),
        "warm": lambda w: deployed(args, w, warm=True),
        "warm-memory": lambda w: deployed(args, w, warm=True, database=False),
        "warm-spawn": lambda w: deployed(args, w, warm=True, fork=False),
        "warm-flower-waits": lambda w: deployed(args, w, warm=True, waits=FLOWER_WAITS),
    }
    chosen = [m for m in args.modes.split(",") if m in modes]
    rows: dict[str, list[dict]] = {m: [] for m in chosen}
    for _ in range(args.repeats):
        for mode in chosen:
            with tempfile.TemporaryDirectory(prefix=f"fedvlm-bench-{mode}-") as tmp:
                rows[mode].append(summary(modes[mode](Path(tmp)), args.round_timeout))
                shown = {k: v for k, v in rows[mode][-1].items() if k not in ("peak_by_program", "cpu_s_per_round")}
                print(f"{mode}: {json.dumps(shown)}")
    means = {m: statistics.mean(r["later_round_mean_s"] for r in runs) for m, runs in rows.items()}
    # a round's median over every run of the mode: one slow round (a noisy neighbour, the last
    # round's evaluation going alone) moves it less than the mean
    medians = {m: statistics.median(s for r in runs for s in r["later_rounds_s"]) for m, runs in rows.items()}
    report = {
        "config": args.run_config,
        "supernodes": args.supernodes,
        "runs": rows,
        "later_round_mean_s": means,
        "later_round_median_s": medians,
    }
    walls = {m: statistics.mean(r["wall_s"] for r in runs) for m, runs in rows.items()}
    report["run_wall_s"] = walls
    if "simulation" in means:
        report["ratio_to_simulation"] = {m: v / means["simulation"] for m, v in means.items()}
        report["median_ratio_to_simulation"] = {m: v / medians["simulation"] for m, v in medians.items()}
        report["run_ratio_to_simulation"] = {m: v / walls["simulation"] for m, v in walls.items()}
    Path(args.out).write_text(json.dumps(bench_report(report), indent=2, default=str))
    print(f"\n{args.supernodes} nodes, {args.method}, {args.rounds} rounds, {os.cpu_count()} CPUs")
    for mode, runs in rows.items():
        ratio = report.get("ratio_to_simulation", {}).get(mode)
        median_ratio = report.get("median_ratio_to_simulation", {}).get(mode)
        run_ratio = report.get("run_ratio_to_simulation", {}).get(mode)
        print(
            f"  {mode:<17} round 1 {statistics.mean(r['round_1_s'] for r in runs):7.1f} s, later rounds "
            f"{means[mode]:7.1f} s"
            + (f" ({ratio:.2f}x simulation)" if ratio else "")
            + f", median {medians[mode]:.2f} s"
            + (f" ({median_ratio:.2f}x)" if median_ratio else "")
            + f", a run {walls[mode]:.0f} s"
            + (f" ({run_ratio:.2f}x)" if run_ratio else "")
            + f", peak {statistics.mean(r['peak_pss_mib'] for r in runs) / 1024:.1f} GiB PSS"
            + f", asked again {sum(r['asked_again'] for r in runs)}, timed out rounds "
            f"{sum(r['rounds_waiting_out_round_timeout'] for r in runs)}"
        )
    print_cpu(rows, args.supernodes)
    print(f"report: {args.out}")


def print_cpu(rows: dict[str, list[dict]], nodes: int) -> None:
    """CPU seconds per later round, per program (mean over a mode's runs), most first; by CPU time,
    not wall time, so machine load does not distort it."""
    for mode, runs in rows.items():
        names = sorted({n for r in runs for n in r["cpu_s_per_round"]})
        per = {n: statistics.mean(r["cpu_s_per_round"].get(n, {}).get("total", 0.0) for r in runs) for n in names}
        total = statistics.mean(r["cpu_s_per_round_total"] for r in runs)
        print(f"  {mode}: {total:.2f} CPU s a round ({total / nodes:.3f} per node)")
        for name, cpu in sorted(per.items(), key=lambda kv: -kv[1]):
            if cpu >= 0.005:
                print(f"    {name:<40} {cpu:7.3f} s  {100 * cpu / total if total else 0:5.1f}%")


if __name__ == "__main__":
    main()
