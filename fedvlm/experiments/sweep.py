"""Sweep methods x epsilon x seeds (and DP-FPL's rank and residual) and write DP-FPL's tables.

    python -m fedvlm.experiments.sweep --out ~/fedvlm-sweeps/embedded               # the embedded default
    python -m fedvlm.experiments.sweep --methods dpfpl --ranks 1,2,4,8 --residual on,off --epsilons none,0.1
    python -m fedvlm.experiments.sweep --preset paper-caltech101 --set data-root=/data/caltech --seeds 0,1,2
    python -m fedvlm.experiments.sweep ... --mia                                     # also attack every run
    python -m fedvlm.experiments.sweep --methods dpfpl --epsilons 1,8 --audit 100     # audit every private run
    python -m fedvlm.experiments.sweep --compare pfedmoap --epsilons none            # pFedMoAP's comparison set
    python -m fedvlm.experiments.sweep --compare pfedmoap --preset paper-pfedmoap-dtd --set data-root=/data
    python -m fedvlm.experiments.sweep --variant prox promptfl prompt.fedprox-mu=0.1  # any labelled variant

Every run is a full federation through the real strategies and ClientApp (in-process by
default; ``--engine flwr`` runs each one through ``flwr run``). Finished runs are reused, so
an interrupted sweep resumes; under ``--set backbone-fingerprint=...`` only those that started
from the pinned weights (one made on another CPU's embedded default is set aside and made again
here, where the pin then has to hold). Outputs in ``--out``:
- ``runs/<name>/``: each run's folder (results.json, plots, published prompts, mia.json);
- ``summary.csv``: one row per run (method, variant, epsilon, seed, metrics, epsilon spent);
- ``table_local.md/.csv``, ``table_neighbor.md/.csv``: mean of the last 10 rounds, mean ± std
  over seeds, methods x epsilon (DP-FPL's Tables 2 and 3; a family whose utility is another
  figure gets a ``table_<figure>.md`` for each, the VLM methods' ``table_client-cider.md``), and
  ``table_mia.md`` with ``--mia``;
- ``table_final.md/.csv``: local accuracy after the last round (pFedMoAP's protocol), with the
  paper's number beside ours when the preset has one;
- ``accuracy_vs_epsilon.png`` (``accuracy_by_variant.png`` when only 'none' ran) and, with
  ``--mia``, ``mia_vs_epsilon.png``, ``table_attacks.md/.csv`` (LiRA and RMIA, pooled, with
  bootstrap intervals; online LiRA with ``--online R``) and ``attack_tpr_vs_epsilon.png`` (their
  TPR at 1% and 0.1% FPR against the accounted epsilon);
- with ``--audit M``: ``table_audit.md/.csv`` and ``audit_vs_accounted.png``, every private run
  audited with M canaries (``privacy.audit-canaries``), its lower bound beside the accounted epsilon.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from fedvlm.attacks import NoAttackApplies
from fedvlm.attacks.reports import GLOBAL, MAXRENYI, MIA
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.errors import PublicError
from fedvlm.experiments.attack_report import attack_row, plot_attacks, predates_chance, write_attack_table
from fedvlm.experiments.presets import COMPARISONS, PRESETS, setup
from fedvlm.experiments.sweep_report import (
    LAST10,
    SPENT,
    audit_row,
    plot,
    plot_audit,
    summary_rows,
    utility_columns,
    write_audit,
    write_failures,
    write_tables,
)
from fedvlm.methods.registry import PROMPT, get_method, methods_of
from fedvlm.methods.validation import validate
from fedvlm.metrics import METRICS, STEPS, TRAIN_CLIENTS
from fedvlm.plots import redraw_run
from fedvlm.runconfig import KEY_BY_NAME, ConfigError, parse_value, pins
from fedvlm.server_app.resume import CHECKPOINT, config_differences
from fedvlm.status import RUN_LOCK
from fedvlm.strategies.records import TRAFFIC_KEYS, TRAIN_ROW, complete
from fedvlm.utils.files import RESULTS, UnreadableFile, atomic_write_records, read_results, try_hold
from fedvlm.utils.progress import each, time_left

log = logging.getLogger("sweep")

EPSILONS = ("none", "0.4", "0.2", "0.1", "0.05", "0.01")


def utility_line(row: dict) -> str:
    """A run's utility for a progress line: its family's first two headline figures, last ten rounds."""
    names = utility_columns([row])[:2]
    return ", ".join(f"{n} {METRICS[n].kind.show(row[n + LAST10])}" for n in names) or "no utility figure"


def run_one(raw: dict, clients: int, engine: str, out: Path) -> dict:
    """Run one config; returns its results.json content."""

    cfg = validate(raw)
    if engine == "inprocess":
        from fedvlm.client_app.app import app as client_app
        from fedvlm.server_app.app import execute
        from fedvlm.utils.inprocess import InProcessGrid

        grid = InProcessGrid(
            client_app, [{PARTITION_ID: i, NUM_PARTITIONS: clients} for i in range(clients)], cfg.as_dict()
        )
        with contextlib.redirect_stdout(io.StringIO()):
            return execute(cfg, grid, run_id=raw["run-name"]).data
    from fedvlm.utils.processes import flwr_env, flwr_run, kill_tree, pids_matching

    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = flwr_run(flwr_env(Path(tmp)), raw, clients, timeout=6 * 3600)
        finally:
            for pid in pids_matching(tmp):
                kill_tree(pid)
    results = Path(raw["output-dir"]) / raw["run-name"] / RESULTS
    if not results.exists():
        log_tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"flwr run of {raw['run-name']} wrote no results.json; its output ends:\n{log_tail}")
    return read_results(results.parent, "the run just made wrote a damaged record; run the sweep again")


RANK = "8"  # a low-rank method's rank where --ranks names none
AUDIT_KEY = "privacy.audit-canaries"
PIN_KEY = "backbone-fingerprint"  # a run reused under a pin must have started from those weights


def without_noise(raw: dict) -> dict:
    """A variant's config for its run without noise: the audit count a variant sets is that of its
    private runs (a run without noise has no mechanism to audit)."""
    return {k: v for k, v in raw.items() if k != AUDIT_KEY}


# a run's traffic in a row: megabytes per node, e.g. 'mb-train-up-per-client'
MB = {key: "mb-" + key.replace("_bytes_", "-").replace("_", "-") + "-per-client" for key in TRAFFIC_KEYS}
REUSED = ("finished", "stopped")  # a run folder's statuses the sweep takes as they are


def other_run(raw: dict, data: dict, finished: bool = True) -> list[str]:
    """Why a run folder does not hold the run ``raw`` asks for: its config's differences (every key
    that changes what a run computes, and for a ``finished`` run its number of rounds: a cut-off
    one may be resumed up to another); empty when it does.

    A folder is found by its name alone, and a name does not say how the run was made: a quick
    board's 2-round runs, or a sweep called with another ``--set``, are named like the full ones.
    """
    now = validate(raw).as_dict()
    saved = data["config"]
    differ = config_differences(saved, now)
    if finished and saved.get("num-server-rounds") != now["num-server-rounds"]:
        differ.append(f"num-server-rounds = {saved.get('num-server-rounds')!r} (now {now['num-server-rounds']!r})")
    return differ


SWEEP_LOCK = "sweep.lock"
# what a sweep says of a run folder whose results.json it cannot read (it changes nothing there)
DAMAGED = "move that run folder away (or restore the file from a backup) and run the sweep again to make the run afresh"


def set_aside(run_dir: Path, why: str) -> None:
    """Rename a run folder the sweep cannot use out of its way, so that nothing is lost; never
    one a live ServerApp holds (another sweep or board running that run now): that is refused."""
    held = try_hold(run_dir / RUN_LOCK) if run_dir.is_dir() else None
    if run_dir.is_dir() and held is None:
        pid = (run_dir / RUN_LOCK).read_text().strip() or "?"
        raise RuntimeError(
            f"{run_dir.name} is being run now by another process ({pid} holds its {RUN_LOCK}): left as it is; run "
            "this sweep again once that run ended, or give this one another --out"
        )
    base = f"{run_dir.name}-{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, k = run_dir.with_name(base), 1
    while aside.exists():  # two folders set aside in one second
        aside, k = run_dir.with_name(f"{base}-{k}"), k + 1
    try:  # renamed while held: a ServerApp starting that run now cannot take the folder in between
        run_dir.rename(aside)
    finally:
        if held is not None:
            held.close()
    log.warning("%s: kept as %s, the run starts afresh", run_dir.name, aside.name)


def continued(raw: dict, run_dir: Path, data: dict | None) -> dict:
    """``raw``, resuming the run cut off in ``run_dir`` (``data``: its results.json) where it
    completed a round.

    Without this the ServerApp, finding the name taken, starts afresh in a stamped folder beside it
    while the sweep goes on reading the stale one. A resumed run with seeded noise ends with the
    very numbers and arrays of an uninterrupted one (``server_app.resume``), so every row of a
    table is still one protocol; with OS noise the ledger charges any abandoned round, so the
    epsilon reported is still what the releases spent. A folder that cannot be resumed (no
    round completed, a run that failed, a run of another config) is kept aside, renamed, and the
    run starts afresh.
    """
    if data is None:
        return raw
    status = data["run"].get("status")
    differ = other_run(raw, data, finished=False)
    rounds, wanted = data["rounds"], validate(raw).num_server_rounds
    # every round asked for is done (and evaluated), or more: nothing to resume to
    done = bool(rounds) and (rounds[-1]["round"] > wanted or rounds[-1]["round"] == wanted and complete(rounds[-1]))
    if differ:
        log.warning("%s holds a run of another config (%s)", run_dir.name, "; ".join(differ))
        set_aside(run_dir, "other-config")
        return raw
    if status != "failed" and not done and (run_dir / CHECKPOINT).is_file():
        log.info("%s was cut off (its status: %s): resuming it from its checkpoint", run_dir.name, status)
        return {**raw, "resume": str(run_dir)}
    log.warning("%s %s and cannot be resumed", run_dir.name, status)
    set_aside(run_dir, str(status))
    return raw


def run_name(variant: str, eps: str, seed: int) -> str:
    """A sweep run's folder name: what a later sweep finds it by."""
    return f"{variant}-eps{eps}-seed{seed}"


def method_variants(methods, ranks, residuals):
    """(label, method, overrides): the rank axis for every low-rank method, and the residual
    ablation for a method that has a '<method>.residual' key (DP-FPL)."""
    for m in methods:
        spec = get_method(m)
        residual_key = f"{m}.residual" if f"{m}.residual" in KEY_BY_NAME else ""
        if not spec.rank_key:
            yield m, m, {}
            continue
        for r, res in itertools.product(ranks, residuals if residual_key else [True]):
            overrides = {spec.rank_key: r, **({residual_key: res} if residual_key else {})}
            yield f"{m}-r{r}" + ("" if res else "-nores"), m, overrides


def _labelled(items: list[list[str]]) -> list[tuple[str, str, dict]]:
    """--variant LABEL METHOD [KEY=VALUE ...] -> (label, method, overrides), checked now so that a
    typo fails before the first run rather than hours into a sweep."""
    out = []
    for label, method, *pairs in items:
        get_method(method)
        overrides = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in KEY_BY_NAME:
                raise SystemExit(f"--variant {label}: {pair!r} is not KEY=VALUE with a run-config key")
            overrides[key] = parse_value(value)
        out.append((label, method, overrides))
    return out


def machine(data: dict) -> str:
    """The machine a run's seconds were measured on: its ServerApp's host (``run.host``) and the
    devices its nodes trained on."""
    run = data.get("run") or {}
    devices = sorted({str((n.get("info") or {}).get("device", "?")) for n in run.get("nodes") or []})
    host = run.get("host")
    where = (
        f"{host['system']} {host['cpu']}, {host['cores']} CPU cores, {host['gpu'] or 'no GPU'}"
        if host
        else "a host the run did not record (made before fedvlm recorded it)"
    )
    return f"{where}; nodes on {', '.join(devices) or '?'}"


CODE_NOT_RECORDED = "not recorded (made before fedvlm recorded it)"


def code(data: dict) -> str:
    """The code a run was made with (``run.fedvlm``): its commit, '+changes' where the package
    differed from it, else its version."""
    made = (data.get("run") or {}).get("fedvlm") or {}
    if made.get("commit"):
        return made["commit"] + ("+changes" if made.get("changed") else "")
    return f"fedvlm {made['version']}" if made.get("version") else CODE_NOT_RECORDED


BACKBONE_UNKNOWN = "not recorded (nor the CPU it ran on)"


def backbone(data: dict) -> str:
    """The weights a run's model started from (``run.backbone.fingerprint``: a hash of them). The
    embedded default is pretrained on the machine that first needs it, and two CPUs' float kernels
    give two sets of weights: runs on different weights are not one method's seeds. A run made
    before its family recorded them is named by the CPU its ServerApp ran on: for an embedded
    default, pretrained where it runs, the CPU that decided its weights."""
    run = data.get("run") or {}
    made = (run.get("backbone") or {}).get("fingerprint")
    cpu = (run.get("host") or {}).get("cpu")
    return str(made) if made else f"not recorded (run on {cpu})" if cpu else BACKBONE_UNKNOWN


def cost_row(data: dict) -> dict:
    """What a run cost and how much it computed: tensor megabytes each node sent and received for
    training and for evaluation (the run's totals over the nodes that joined), the median seconds
    per round and the rounds' seconds in total, the machine they were measured on, and its compute
    (``compute_row``)."""
    nodes = max(1, len((data.get("run") or {}).get("nodes") or []))
    final, rounds = data["final"], data["rounds"]
    return {
        "machine": machine(data),
        "code": code(data),
        "backbone": backbone(data),
        # a run made before traffic was split by purpose holds only its totals: its split is unknown, not 0
        **{MB[key]: final[key] / nodes / 1e6 if key in final else None for key in TRAFFIC_KEYS},
        # the median: one round a paused or busy machine held up does not set the run's figure
        "seconds-per-round": float(np.median([r["seconds"] for r in rounds])) if rounds else None,
        "seconds-total": sum(r["seconds"] for r in rounds),
        **compute_row(data),
    }


def compute_row(data: dict) -> dict:
    """The compute a run's figures rest on, as its rounds recorded it: rounds, the nodes trained
    per round, the local steps a trained node ran per round (mean), and the local steps each node
    ran over the run (mean over the nodes): the budget two rows are matched on."""
    rounds, nodes = data["rounds"], max(1, len((data.get("run") or {}).get("nodes") or []))
    steps = [row[TRAIN_ROW + STEPS] for r in rounds for row in r["clients"].values() if TRAIN_ROW + STEPS in row]
    trained = [r["metrics"].get(TRAIN_CLIENTS, 0) for r in rounds]
    return {
        "rounds": len(rounds),
        "clients-per-round": float(np.mean(trained)) if rounds else None,
        "local-steps-per-round": float(np.mean(steps)) if steps else None,
        "local-steps-per-client": sum(steps) / nodes,
    }


class IdleRound(RuntimeError):
    """A run finished with a round in which no node it sampled trained (``idle_rounds``)."""


def idle_rounds(data: dict) -> list[int]:
    """The rounds of a finished run in which no node it sampled trained: every reply lost (a machine
    paused or overloaded past the round's timeout), which no config asks for. Such a run trained less
    than its row's compute says, so a sweep does not reuse it as finished."""
    return [r["round"] for r in data["rounds"] if r.get("sampled") and not r["metrics"].get(TRAIN_CLIENTS, 1)]


def attack_columns(run_dir: Path, family, shadows: int, online: int, trains: bool = True) -> dict:
    """A run's membership-attack columns: the family's attacks, pooled over clients with their
    intervals (``Family.membership_attack``), and Shokri's and the loss threshold's accuracy and
    AUC where the prompt family's mia.json has them. An attack that cannot run, a method that
    trains nothing on the clients' data (``trains``), or a family none applies to yet, is the row's
    ``mia-error``, not the sweep's end."""
    attack = family.attack
    if not trains:
        return {"mia-error": "the method trains nothing on the clients' data: there is no membership to infer"}
    if attack is None:
        return {"mia-error": f"no membership attack applies to the {family.name} family yet"}
    try:
        row = attack_row(attack(run_dir, shadows, online))
    except NoAttackApplies as err:
        return {"mia-error": str(err)}
    except Exception as err:  # noqa: BLE001 - a run the attacks cannot take is a row without them
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        log.error("%s: the membership attacks could not run: %s", run_dir.name, reason)
        return {"mia-error": reason}
    mia_path = run_dir / MIA
    if mia_path.exists():
        mia = json.loads(mia_path.read_text())["summary"]
        row.update(
            {
                "mia-shokri-acc": mia["shokri"]["accuracy"],
                "mia-shokri-auc": mia["shokri"]["auc"],
                "mia-loss-acc": mia["loss-threshold"]["accuracy"],
                "mia-loss-auc": mia["loss-threshold"]["auc"],
            }
        )
    return row


def report_stamps(run_dir: Path) -> dict[str, int]:
    """When each attack report in a run folder was last written (to tell one made just now)."""
    return {n: (run_dir / n).stat().st_mtime_ns for n in (MIA, MAXRENYI, GLOBAL) if (run_dir / n).exists()}


def failed_row(variant: str, method: str, eps: str, seed: int, err: BaseException) -> dict:
    reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return {"variant": variant, "method": method, "epsilon": eps, "seed": seed, "status": "failed", "error": reason}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path.home() / "fedvlm-sweeps" / "sweep")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (default: every DP-capable prompt method, unless --compare or --variant)",
    )
    p.add_argument("--compare", choices=sorted(COMPARISONS), help="a named comparison set of labelled variants")
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar="LABEL METHOD [KEY=VALUE",
        help="a labelled variant: LABEL METHOD KEY=VALUE... (repeatable)",
    )
    p.add_argument("--epsilons", default=",".join(EPSILONS), help="'none' = no noise")
    p.add_argument("--seeds", type=whole_numbers, default="0")
    p.add_argument("--ranks", type=whole_numbers, default=RANK)
    p.add_argument("--residual", default="on", help="on, off or on,off (DP-FPL's ablation)")
    p.add_argument("--clients", type=int, default=None, help="clients per run (default: the preset's, else 10)")
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides for every run")
    p.add_argument("--engine", choices=("inprocess", "flwr"), default="inprocess")
    p.add_argument("--mia", action="store_true", help="run the membership-inference attacks on every run")
    p.add_argument(
        "--audit",
        type=int,
        default=0,
        metavar="M",
        help="audit every private run with M canaries (privacy.audit-canaries, unless a variant or --set names "
        "its own): table_audit.md, audit_vs_accounted.png",
    )
    p.add_argument("--shadows", type=int, default=2)
    p.add_argument(
        "--online", type=int, default=0, help="with --mia: online-LiRA reference federations per run (even; 0 = none)"
    )
    return p


Entry = tuple[str, str, dict, str, int]  # a planned run: variant, method, its overrides, epsilon, seed


@dataclass
class Sweep:
    """One invocation's plan and what it has made: every run's config, its row in summary.csv and
    the tables, rewritten after each run (a failed one too)."""

    args: argparse.Namespace
    out: Path
    base: dict
    clients: int
    reference: dict | None
    epsilons: list[str]
    plan: list[Entry]
    refused: dict[str, ConfigError] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    # summary.csv's rows when this call began: each written back with every report until this call
    # has a row of its own for that run, so that a sweep stopped half-way loses none of them
    earlier: list[dict] = field(default_factory=list)
    lock: IO[str] | None = None  # the folder's SWEEP_LOCK, held for the sweep's life
    ran: int = 0  # the runs this invocation trained (a reused one costs nothing), for the estimate
    ran_seconds: float = 0.0

    def raw(self, variant: str, method: str, extra: dict, eps: str, seed: int) -> dict:
        raw = {
            **self.base,
            **extra,
            "method": method,
            "seed": seed,
            "privacy.epsilon": 0.0 if eps == "none" else float(eps),
            "output-dir": str(self.out / "runs"),
            "run-name": run_name(variant, eps, seed),
        }
        private = eps != "none" or get_method(method).family.noise_multiplier > 0
        if not private:
            return without_noise(raw)
        if self.args.audit and AUDIT_KEY not in raw:  # a variant's own setting wins
            raw[AUDIT_KEY] = self.args.audit
        return raw

    def check(self) -> None:
        """Every run's config checked before the first starts: an impossible pair (FedOTP on a
        ResNet CLIP) is a failed row at once, not a crash hours in."""
        for entry in self.plan:
            raw = self.raw(*entry)
            try:
                validate(raw)
            except ConfigError as err:
                self.refused[raw["run-name"]] = err
                log.error("%s cannot run: %s", raw["run-name"], err)

    def report(self) -> None:
        def run_of(r: dict) -> tuple[str, ...]:  # a row read back holds text, one made here numbers
            return str(r.get("variant")), str(r.get("epsilon")), str(r.get("seed"))

        mine = {run_of(r) for r in self.rows}
        kept = [r for r in self.earlier if run_of(r) not in mine]
        atomic_write_records(self.rows + kept, self.out / "summary.csv")  # a reader never sees half
        done = [r for r in self.rows if r["status"] != "failed"]
        write_tables(self.rows, self.out, self.epsilons, self.reference)
        write_failures(self.rows, self.out)
        write_audit(done, self.out)
        write_attack_table(
            done,
            self.out,
            "the published personalised prompts (server-*: every upload the server saw, attack.observe-uploads)",
        )

    def fail(self, i: int, entry: Entry, err: BaseException) -> None:
        variant, method, _, eps, seed = entry
        self.rows.append(failed_row(variant, method, eps, seed, err))
        log.error("[%d/%d] %s failed: %s", i, len(self.plan), run_name(variant, eps, seed), self.rows[-1]["error"])
        self.report()

    def not_reusable(self, raw: dict, method: str, run_dir: Path, reused: dict) -> str:
        """Why a finished run in this folder is not this run's row ("" if it is): a run of another
        config under its name, a round no node trained in, or attacks older than the sweep's."""
        differ = other_run(raw, reused)
        if differ:
            log.warning("%s holds a run of another config (%s)", run_dir.name, "; ".join(differ))
            return "other-config"
        if not pins(str(raw.get(PIN_KEY, "")), backbone(reused)):
            log.warning("%s ran on weights %s, not the pinned %s", run_dir.name, backbone(reused), raw[PIN_KEY])
            return "other-backbone"
        idle = idle_rounds(reused)
        if idle:
            log.warning(
                "%s: no node trained in round(s) %s; its row would not be the run's compute", run_dir.name, idle
            )
            return "idle-round"
        return "old-attacks" if self.args.mia and self.old_attacks(method, run_dir) else ""

    def run(self, i: int, entry: Entry) -> None:
        """The ``i``-th planned run: reused where this folder finished it, else run (or resumed)."""
        variant, method, _, eps, seed = entry
        raw = self.raw(*entry)
        name = raw["run-name"]
        if name in self.refused:
            self.rows.append(failed_row(variant, method, eps, seed, self.refused[name]))
            return self.report()
        run_dir, t0 = self.out / "runs" / name, time.time()
        try:
            prior = read_results(run_dir, DAMAGED) if (run_dir / RESULTS).exists() else None
        except UnreadableFile as err:  # the user's file: said, left as it is, the sweep goes on
            return self.fail(i, entry, err)
        reused = prior if prior is not None and prior["run"].get("status") in REUSED else None
        fresh = reused is None
        try:
            aside = self.not_reusable(raw, method, run_dir, reused) if reused is not None else ""
            if aside:  # kept beside it under that reason; the run is made afresh
                set_aside(run_dir, aside)
                reused, prior, fresh = None, None, True
            data = (
                reused
                if reused is not None
                else run_one(continued(raw, run_dir, prior), self.clients, self.args.engine, self.out)
            )
            idle = [] if reused is not None else idle_rounds(data)  # a reused run was checked above
            if idle:  # made (or resumed) just now with a round no node trained in: not its row
                raise IdleRound(
                    f"no node trained in round(s) {', '.join(map(str, idle))} (every reply lost: the "
                    "machine paused or overloaded past round-timeout); run the sweep again on a quieter machine: "
                    "the run is then set aside and made afresh"
                )
        except Exception as err:  # noqa: BLE001 - a failed variant is a row of the table, not the sweep's end
            return self.fail(i, entry, err)
        try:
            row = result_row(variant, method, eps, seed, data)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as err:  # a damaged (reused) record
            return self.fail(i, entry, UnreadableFile(f"{run_dir / RESULTS}: {type(err).__name__} {err}; {DAMAGED}"))
        if self.args.mia:
            self.attack(run_dir, method, row)
        self.rows.append(row)
        if fresh:
            self.ran, self.ran_seconds = self.ran + 1, self.ran_seconds + time.time() - t0
        mia = f" MIA {100 * row['mia-shokri-acc']:.1f}%" if "mia-shokri-acc" in row else ""
        left = time_left(self.ran, self.ran + len(self.plan) - i, self.ran_seconds)
        progress = left or ("done" if i == len(self.plan) else "reused")
        log.info(
            "[%d/%d] %s: %s%s (%.0fs; %s)", i, len(self.plan), name, utility_line(row), mia, time.time() - t0, progress
        )
        return self.report()

    @staticmethod
    def old_attacks(method: str, run_dir: Path) -> bool:
        """Whether the finished run's attack report predates the figures' chance levels."""
        read = get_method(method).family.reported_attacks
        return read is not None and predates_chance(read(run_dir))

    def attack(self, run_dir: Path, method: str, row: dict) -> None:
        spec = get_method(method)
        before = report_stamps(run_dir)
        row.update(attack_columns(run_dir, spec.family, self.args.shadows, self.args.online, spec.trains))
        if report_stamps(run_dir) != before:  # attacked now: the privacy picture names the best
            try:
                redraw_run(run_dir)
            except Exception as err:  # noqa: BLE001 - a picture must not end the sweep
                log.warning("%s: could not redraw its pictures: %s: %s", run_dir.name, type(err).__name__, err)

    def finish(self, started: float) -> int:
        done = [r for r in self.rows if r["status"] != "failed"]
        plot(done, self.out, self.epsilons)
        plot_audit(done, self.out)
        plot_attacks(done, self.out)
        for tag in [*write_tables(self.rows, self.out, self.epsilons, self.reference), "attacks", "audit", "failures"]:
            if (self.out / f"table_{tag}.md").exists():
                print((self.out / f"table_{tag}.md").read_text())
        log.info("sweep of %d runs done in %.0fs: %s", len(self.plan), time.time() - started, self.out)
        return 0 if done else 1  # not one run finished: the sweep failed, whatever the rows say


def _prepare(p: argparse.ArgumentParser, args: argparse.Namespace) -> Sweep:
    """The sweep the arguments ask for, every argument checked before its folder is made."""
    epsilons, seeds, ranks, residuals = _lists(p, args)
    if any(len(v) < 2 for v in args.variant):
        p.error("--variant needs LABEL METHOD [KEY=VALUE ...]")
    try:
        base, clients, reference = setup(args.preset, args.set, args.clients)
        variants = COMPARISONS.get(args.compare, []) + _labelled(args.variant)
        if args.methods is not None or not variants:
            methods = args.methods or ",".join(m.name for m in methods_of(PROMPT) if m.supports_dp)
            variants = list(method_variants(methods.split(","), ranks, residuals)) + variants
        # A method without a DP mechanism runs at 'none' only (zero-shot, CoOp in a comparison set).
        plan = [
            (v, m, extra, e, s)
            for (v, m, extra) in variants
            for e in epsilons
            if e == "none" or get_method(m).supports_dp
            for s in seeds
        ]
    except (PublicError, ValueError) as err:  # an unknown method, a --set without '=': the arguments' fault
        p.error(str(err))
    if not plan:
        p.error(f"nothing to run: no method here has a privacy mechanism for --epsilons {args.epsilons}")
    out = args.out.expanduser().resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    # one sweep a folder at a time: a second would write summary.csv over the first's rows, or set
    # aside a run folder the first is still auditing or attacking (it holds no run.lock then)
    lock = try_hold(out / SWEEP_LOCK)
    if lock is None:
        pid = (out / SWEEP_LOCK).read_text().strip() or "?"
        p.error(f"another sweep (process {pid}) is writing to {out} now: wait for it to end, or use another --out")
    earlier = [reread(row, out) for row in summary_rows(out / "summary.csv")]
    return Sweep(args, out, base, clients, reference, epsilons, plan, earlier=earlier, lock=lock)


def reread(row: dict, out: Path) -> dict:
    """An earlier call's row of summary.csv, its run's columns read again from the run's
    results.json where the run is finished: a row written before a column existed (the weights, the
    code) kept that cell empty on every later page, which then read the empty cell as other weights
    and named the row as mixing two backbones. The attack columns stay as written: they are the
    attacks' reports, not run again. A row whose run is gone, failed or unreadable stays as written."""
    try:
        seed = int(float(row["seed"]))
        run_dir = out / "runs" / run_name(row["variant"], row["epsilon"], seed)
        data = read_results(run_dir, DAMAGED) if (run_dir / RESULTS).exists() else None
        if data is None or data["run"].get("status") not in REUSED:
            return row
        return {**row, **result_row(row["variant"], row["method"], row["epsilon"], seed, data)}
    except (UnreadableFile, KeyError, TypeError, AttributeError, ValueError, IndexError):
        return row  # a damaged record: a call that plans its run says why


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for name in ("strategies", "server_app", "fedvlm", "models", "data", "alembic"):  # alembic: Flower's DB setup
        logging.getLogger(name).setLevel(logging.WARNING)
    sweep, started = _prepare(p, args), time.time()
    try:
        sweep.check()
        for i, entry in enumerate(each(sweep.plan, "sweep", "run"), 1):
            sweep.run(i, entry)
        return sweep.finish(started)
    finally:
        if sweep.lock is not None:
            sweep.lock.close()


def whole_numbers(text: str) -> tuple[int, ...]:
    """An argparse type, for every experiment command's --seeds: a comma-separated list of whole
    numbers ('' for none, where a command's default then applies)."""
    try:
        return tuple(int(x) for x in text.split(",")) if text.strip() else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def _lists(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[int], list[int], list[bool]]:
    """--epsilons, --seeds, --ranks and --residual, read or refused before anything is made (the
    seeds and ranks by their type, ``whole_numbers``)."""
    epsilons = [e.strip() for e in args.epsilons.split(",")]
    for e in epsilons:
        try:
            if e != "none" and not 0 < float(e) <= 100:
                raise ValueError
        except ValueError:
            p.error(f"--epsilons: {e!r} is neither 'none' nor a target epsilon in (0, 100]")
    residual = [x.strip() for x in args.residual.split(",")]
    if set(residual) - {"on", "off"}:
        p.error(f"--residual: {args.residual!r} must be on, off or on,off")
    if args.clients is not None and args.clients < 1:
        p.error(f"--clients: {args.clients} must be at least 1")
    return epsilons, list(args.seeds), list(args.ranks), [x == "on" for x in residual]


def result_row(variant: str, method: str, eps: str, seed: int, data: dict) -> dict:
    """A run's row of summary.csv, from its results.json (``data``)."""
    row = {"variant": variant, "method": method, "epsilon": eps, "seed": seed, "status": data["run"]["status"]}
    if row["status"] == "failed":  # the ServerApp stopped with an error and said why
        row["error"] = str(data["run"].get("note") or "the run failed").splitlines()[0][:300]
    spent = (data.get("privacy", {}).get("rounds") or [{}])[-1]
    row[SPENT] = spent.get("epsilon")  # per record, every mechanism composed
    settings = (data.get("privacy") or {}).get("settings") or {}
    if row[SPENT] is not None:  # under which accountant, at which delta
        row["accountant"], row["delta"] = settings.get("accountant"), settings.get("delta")
    row["noise-multiplier"] = data["config"].get("privacy.noise-multiplier")  # a family's fixed noise (z)
    row.update(cost_row(data))
    final = data["final"]  # the family's headline figures: the last round's and the mean of the last 10
    row.update({k: v for k, v in final.items() if k.endswith(LAST10) or k + LAST10 in final})
    row.update(audit_row(data))
    return row


if __name__ == "__main__":
    sys.exit(main())
