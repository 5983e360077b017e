"""Benchmark: what a round's privacy bookkeeping and results.json write cost as the planned
clients grow, with the clients charged per round held fixed (1%).

For each size: a DP-FPL plan for N clients with a budget stop (``privacy.max-epsilon``, checked
before every round), made by ``RunBudget.planned`` as the strategy makes it; then rounds that
charge N/100 clients, each followed by the ledger's entry. Per round it prints the seconds of
the charge (the budget check included) and of the entry, how much the ledger grew, and the
seconds to encode results.json's privacy section and a node table of N nodes whole
(``utils.files.json_text``) and with the entries kept between writes (``PartsKeptJson``, where
this fedvlm has it), side by side in one process. It uses only what every fedvlm since the
ledger had (``planned``, ``charge_round``, ``record_round``, ``ledger_section``), so the same
script measures an earlier commit (run it from that commit's checkout).

    python bench/ledger_scale.py --clients 1000,10000 --rounds 4 [--out ledger_scale.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import time
from pathlib import Path

from bench.measure import bench_report
from fedvlm.methods.validation import validate
from fedvlm.privacy.budget import RunBudget
from fedvlm.privacy.ledger import PrivacyLedger
from fedvlm.privacy.planner import ClientShape
from fedvlm.spec import spec_of

# what this fedvlm writes results.json with; an earlier one encoded the whole file every write
_files = importlib.import_module("fedvlm.utils.files")
json_text = getattr(_files, "json_text", functools.partial(json.dumps, allow_nan=False))
PartsKeptJson = getattr(_files, "PartsKeptJson", None)
KEPT_ENTRIES = getattr(importlib.import_module("fedvlm.server_app.results"), "KEPT_ENTRIES", ())


def node_table(n: int) -> list[dict]:
    """A node table like results.json's ``run.nodes`` (about 500 bytes a node)."""
    backbone = "embedded-tiny:gelu:sha256:d1a5e0f1dac12aec"
    return [
        {
            "node_id": str(10**12 + i),
            "name": f"client-{i}",
            "partition_id": i,
            "num_train": 40,
            "num_test": 10,
            "num_neighbor": 90,
            "backbone": backbone,
            "num_classes": 40,
            "info": {"name": f"client-{i}", "backbone": backbone, "noise-source": "os", "classes": "4,11,24,27"},
            "num_partitions": n,
            "noise_source": "os",
            "class_list": "b29be104e572d37f",
        }
        for i in range(n)
    ]


def measure(n: int, rounds: int) -> dict:
    settings = {
        "privacy.epsilon": 2.0,
        "privacy.max-epsilon": 2.0,
        "privacy.delta": 1e-8,
    }  # a budget stop: checked a round
    cfg = validate({"method": "dpfpl", **settings, "num-server-rounds": 20})
    shapes = {f"client-{i}": ClientShape(40 + i % 7, 32, 1) for i in range(n)}
    charged = max(1, n // 100)
    t = time.perf_counter()
    budget = RunBudget.planned(
        cfg.privacy,
        PrivacyLedger(cfg.privacy, spec_of(cfg).name),
        cfg.num_server_rounds,
        spec_of(cfg).local_dp(cfg),
        spec_of(cfg).global_dp(cfg, charged),
        shapes,
        dict.fromkeys(shapes, "os"),
    )
    plan_s = time.perf_counter() - t
    data = {"run": {"nodes": node_table(n)}, "rounds": [], "privacy": budget.ledger_section()}
    kept = PartsKeptJson(KEPT_ENTRIES) if PartsKeptJson is not None else None
    if kept is not None:
        kept.encode(data)  # a run's first write encodes everything
    size = len(json_text(data["privacy"]))
    rows = []
    for r in range(1, rounds + 1):
        names = [f"client-{(r * charged + k) % n}" for k in range(charged)]
        t = time.perf_counter()
        budget.charge_round(names)
        charge_s = time.perf_counter() - t
        t = time.perf_counter()
        budget.record_round(r, {})
        record_s = time.perf_counter() - t
        data["privacy"] = budget.ledger_section()
        grown = len(json_text(data["privacy"])) - size
        size += grown
        t = time.perf_counter()
        whole = json_text(data)
        whole_s = time.perf_counter() - t
        row = {"round": r, "charge_s": charge_s, "record_s": record_s, "ledger_grew_kib": grown / 1024}
        row.update({"encode_whole_s": whole_s, "results_json_mib": len(whole) / 2**20})
        if kept is not None:
            t = time.perf_counter()
            text = kept.encode(data)
            row["encode_kept_s"] = time.perf_counter() - t
            assert json.loads(text) == json.loads(whole)
        rows.append(row)
    later = rows[1:] or rows  # the first round after the plan fills caches
    summary = {k: statistics.median(r[k] for r in later) for k in rows[0] if k != "round"}
    return {"clients": n, "charged_per_round": charged, "plan_s": plan_s, "rounds": rows, "median": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1000,10000")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("ledger_scale.json"))
    args = p.parse_args()
    results = []
    for n in (int(x) for x in args.clients.split(",")):
        res = measure(n, args.rounds)
        results.append(res)
        m = res["median"]
        kept = f", kept {m['encode_kept_s']:.3f} s" if "encode_kept_s" in m else ""
        print(
            f"{n} clients ({res['charged_per_round']} charged a round; medians of rounds 2-{args.rounds}): "
            f"charge {m['charge_s']:.3f} s, ledger entry {m['record_s']:.3f} s, ledger +{m['ledger_grew_kib']:.1f} "
            f"KiB a round, results.json {m['results_json_mib']:.1f} MiB encoded whole {m['encode_whole_s']:.3f} s"
            f"{kept}",
            flush=True,
        )
    args.out.write_text(json.dumps(bench_report({"clients": args.clients, "results": results}), indent=1))


if __name__ == "__main__":
    main()
