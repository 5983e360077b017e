"""A run's outputs: one folder holding results.json, the shared parameters and plots.

``results.json`` is rewritten (atomically) after every round, so a crashed run keeps every
round it finished, and holds only strict JSON (a non-finite number is null). ``status.json``
beside it holds the run's status and note in a fixed-size file made when the run starts and
overwritten in place, so that even on a full disk, where results.json can no longer be
rewritten, the run still ends as failed with its error (``python -m fedvlm.status`` reads it).
A run config the ServerApp refuses leaves a run folder too, failed with the reason
(``RunRecorder.refused``). results.json's top-level keys:
- ``config``: the validated, resolved run config;
- ``run``: method, backbone, nodes, versions, start time, status;
- ``rounds``: one object per round with ``round``, ``sampled`` (train messages sent),
  ``evaluated`` (false until the round's evaluation is back; null for a round not evaluated,
  ``evaluate-every``), ``metrics``, ``seconds``,
  ``train_bytes_up``, ``train_bytes_down``, ``evaluate_bytes_up``, ``evaluate_bytes_down``
  (the round's traffic by purpose, ``strategies.records.TRAFFIC``; ``bytes`` by phase),
  ``clients`` (per-client metrics), ``dropped`` (rejected replies and why);
- ``final``: the summary (last-round and mean-of-last-10-rounds metrics, totals).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.metadata
import io
import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedvlm.metrics import METRICS
from fedvlm.privacy.ledger import round_changes
from fedvlm.runconfig import ConfigError
from fedvlm.server_app.tracking import Trackers
from fedvlm.strategies.records import TRAFFIC, TRAFFIC_KEYS
from fedvlm.utils.files import (
    PartsKeptJson,
    atomic_torch_save,
    atomic_write_text,
    load_json,
    overwrite_in_place,
)
from fedvlm.utils.paths import default_output_dir

log = logging.getLogger(__name__)

ROUNDS_CSV = "rounds.csv"
# results.json's tables with an entry per node, whose entries are replaced, never changed in
# place: their text is kept between writes (``utils.files.PartsKeptJson``)
KEPT_ENTRIES = (
    ("run", "nodes"),
    ("privacy", "client_mechanisms"),
    ("privacy", "records"),
    ("privacy", "spent"),
    ("privacy", "by_accountant"),
    ("privacy", "client_reported"),
)
# a round's own columns before its metrics
ROUND_COLUMNS = ("round", "evaluated", "seconds", "sampled", *TRAFFIC_KEYS)
CLIENT_COLUMN = "client"  # the node a row is about; empty in a round's own row
NODE_EPSILON_COLUMN = "epsilon"  # a node's row: what a record of it has spent after the round (the ledger)
STATUS_FILE, STATUS_BYTES = "status.json", 8192


def make_run_dir(output_dir: str, run_name: str, method: str, dataset: str, run_id: int | str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = run_name or f"{method}-{dataset}-{stamp}-{run_id}"
    path = Path(output_dir) / name
    if path.exists() and (not path.is_dir() or any(path.iterdir())):  # a used folder, or a file: a new one beside
        path = Path(output_dir) / f"{name}-{stamp}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # output-dir (or a folder above it) is a file, or not writable
        raise ConfigError(
            f"run config 'output-dir' = {output_dir!r}: cannot make the run folder {path} ({err.strerror}); name a "
            "folder this account can write (it is made if missing)"
        ) from err
    return path.resolve()


def host() -> dict:
    """The machine the ServerApp runs on (in a simulation, its nodes' too): what the run's seconds
    were measured on. The nodes name their own device (``run.nodes``' info)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):  # Linux names the model there; platform does not
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
                break
    gpu = None
    with contextlib.suppress(Exception):  # informative only: a GPU in a bad state must not stop the run
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"system": platform.system(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu}


def source() -> dict:
    """The code a run is made with: fedvlm's installed version and, where the package is a git
    checkout's own ``fedvlm/``, its commit and whether the package differs from it (a board that
    mixes runs of several commits says so, ``experiments.leaderboard.code_versions``)."""
    out: dict[str, Any] = {"version": None, "commit": None, "changed": None}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["version"] = importlib.metadata.version("fedvlm")
    root = Path(__file__).resolve().parents[2]
    # no optional locks: a run never takes the index lock a user's own git command may need; no
    # timeout: git's wait is then a blocking waitpid, not subprocess's polling loop of sleeps
    git = ["git", "--no-optional-locks", "-C", str(root)]
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no git, or not a checkout: the version alone
        top = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
            head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
            changes = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no", "--", "fedvlm"], capture_output=True, text=True
            )
            if head.returncode == 0 and changes.returncode == 0:
                out.update(commit=head.stdout.strip(), changed=bool(changes.stdout.strip()))
    return out


class RunRecorder:
    # inside how many one_write blocks, and whether they owe a write (class defaults: reopen and
    # left_running make a recorder without __init__)
    _held: int = 0
    _pending: bool = False
    _json: PartsKeptJson | None = None  # results.json's encoder, made at the first write

    def __init__(self, run_dir: Path, config: dict, run_info: dict):
        self.dir = Path(run_dir)
        self.data: dict[str, Any] = {
            "config": config,
            "run": {
                **run_info,
                "status": "running",
                "started": datetime.now(timezone.utc).isoformat(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "host": host(),
                "fedvlm": source(),
            },
            "rounds": [],
            "final": {},
        }
        self.t0 = time.time()
        self.trackers: Trackers | None = None
        # the fixed-size status file first: once it exists it records how the run ends, even
        # when the disk fills up and results.json can no longer be written
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.write_status()
            self.write()
        except OSError as err:
            self.data["run"].update(status="failed", note=f"the run folder could not be written: {err}")
            with contextlib.suppress(OSError):
                self.write_status()
            raise OSError(
                err.errno, f"cannot write the run folder {self.dir} ({err}): free space on its disk, or set output-dir"
            ) from err

    @classmethod
    def refused(cls, raw: dict, run_id: int | str, reason: str) -> RunRecorder:
        """A run folder for a run config the ServerApp refused: failed, with the reason (so that
        ``fedvlm.status`` does not report the previous run)."""
        given = raw.get("output-dir")
        out = Path(given).expanduser() if isinstance(given, str) and given else default_output_dir()
        out = out if out.is_absolute() else default_output_dir()
        name = str(raw.get("run-name") or "")
        run_dir = make_run_dir(str(out), name, "invalid-config", str(raw.get("dataset", "")), run_id)
        recorder = cls(run_dir, {k: raw[k] for k in sorted(raw)}, {"run_id": str(run_id)})
        recorder.finish("failed", f"invalid run config: {reason}")
        return recorder

    @classmethod
    def reopen(cls, run_dir: Path, results: dict, upto: int, config: dict, run_id: str) -> RunRecorder:
        """Go on writing an interrupted run's folder from round ``upto`` (later rounds, recorded
        after the checkpoint was written, are dropped: they will be run again). Nothing is
        written until the run records something, so a resume refused on the way leaves the
        folder as it was."""
        recorder = cls.__new__(cls)
        recorder.dir, recorder.t0, recorder.trackers = Path(run_dir), time.time(), None
        data = dict(results)
        data["config"] = config
        data["rounds"] = [r for r in data["rounds"] if r["round"] <= upto]
        data["final"] = {}
        run = {k: v for k, v in data["run"].items() if k not in ("note", "ended")}
        resumed = {"from_round": upto, "run_id": run_id, "at": datetime.now(timezone.utc).isoformat()}
        data["run"] = {**run, "status": "running", "resumed": [*run.get("resumed", []), resumed]}
        recorder.data = data
        return recorder

    @classmethod
    def left_running(cls, run_dir: Path) -> RunRecorder:
        """The folder of a run whose ServerApp ended without finishing it (``fedvlm.stop`` ended
        it), to record how it ended as that ServerApp would have: ``finish`` writes the status,
        the summary (its seconds counted from the run's start) and the plots, and ends the run in
        the trackers it was logging to (their last figures, the folder's files, its status)."""
        recorder = cls.__new__(cls)
        recorder.dir, recorder.trackers = Path(run_dir), None
        recorder.data = load_json(recorder.path, "the run folder cannot record how it ended")
        started = recorder.data.get("run", {}).get("started")
        recorder.t0 = datetime.fromisoformat(started).timestamp() if started else time.time()
        if recorder.data.get("run", {}).get("status") == "running":  # its trackers are still told it runs
            trackers = Trackers.reattached(recorder.data, recorder.dir)
            if trackers.make:
                recorder.trackers = trackers
                recorder.data["run"]["tracking"] = trackers.start(recorder.data, resumed=True, ended=False)
        return recorder

    @property
    def path(self) -> Path:
        return self.dir / "results.json"

    def track(self, trackers: Trackers, resumed: bool, ended: bool = True) -> None:
        """Send the run to ``trackers`` from now on (``server_app.tracking``; ``resumed`` and
        ``ended`` as ``Trackers.start`` takes them); what they are is recorded in results.json's
        ``run.tracking``."""
        self.trackers = trackers
        info = trackers.start(self.data, resumed, ended)
        if info:
            self.set_run_info(tracking=info)

    @contextlib.contextmanager
    def one_write(self) -> Iterator[None]:
        """The writes asked for inside, made once at its end: each rewrites the whole of
        results.json and rounds.csv, which grow with the rounds and the nodes, so a round's
        several updates cost one rewrite (what is on disk when the round's checkpoint is saved is
        the same)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self._pending:
            self.write()

    def write(self) -> None:
        """results.json, the rounds as a table beside it (``ROUNDS_CSV``), and to the trackers
        what is new."""
        if self._held:
            self._pending = True
            return
        self._pending = False
        if self._json is None:
            self._json = PartsKeptJson(KEPT_ENTRIES)
        atomic_write_text(self._json.encode(self.data), self.path)
        atomic_write_text(rounds_csv(self.data), self.dir / ROUNDS_CSV)
        if self.trackers is not None:
            self.trackers.update(self.data)

    def write_status(self) -> None:
        run = self.data["run"]
        text = json.dumps({"status": run["status"], "note": run.get("note", ""), "ended": run.get("ended")})
        overwrite_in_place(self.dir / STATUS_FILE, text, STATUS_BYTES)

    def set_run_info(self, **info) -> None:
        self.data["run"].update(info)
        self.write()

    def add_section(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def add_round(self, record: dict) -> None:
        self.data["rounds"].append(record)
        self.write()

    def save_arrays(self, name: str, arrays: dict[str, np.ndarray], server_round: int) -> None:
        atomic_torch_save(
            {"round": server_round, "arrays": {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}},
            self.dir / name,
        )

    def final_summary(self) -> dict:
        rounds = self.data["rounds"]
        final: dict = {
            "rounds": len(rounds),
            "seconds": round(time.time() - self.t0, 2),
            **{key: int(sum(r[key] for r in rounds)) for key in TRAFFIC_KEYS},
        }
        for key in (m.name for m in METRICS.values() if m.headline):
            series = [r["metrics"][key] for r in rounds if key in r["metrics"]]
            if series:
                final[f"{key}"] = series[-1]
                final[f"{key}-last10-mean"] = float(np.mean(series[-10:]))
        return final

    def finish(self, status: str = "finished", note: str = "") -> dict:
        """Record how the run ended: the summary, the plots, results.json and the status file. A
        run whose results.json cannot be written (a full disk) ends as failed, with the error, in
        the status file made when it began: its outputs are incomplete, whatever its rounds did."""
        self.data["final"] = self.final_summary()
        self.data["run"]["status"] = status
        if note:
            self.data["run"]["note"] = note
        self.data["run"]["ended"] = datetime.now(timezone.utc).isoformat()
        try:
            from fedvlm.plots import draw_run

            self.data["run"]["plots"] = draw_run(self.data, self.dir)
        except Exception as err:  # a plot must never lose the results; results.json says why it is missing
            log.warning("could not draw plots: %s", err)
            self.data["run"]["plots"] = f"not drawn: {type(err).__name__}: {str(err)[:300]}"
        try:
            self.write()
            self.write_status()  # before the trackers take the folder's files: it says how the run ended
            if self.trackers is not None:  # after the last write: the trackers get the folder as it ends
                tracked = self.trackers.finish(self.data, self.dir)
                if tracked != self.data["run"].get("tracking"):
                    self.data["run"]["tracking"] = tracked
                    self.write()
        except OSError as err:
            done = "every round finished, but " if status == "finished" else ""
            self.data["run"]["status"] = "failed"
            self.data["run"]["note"] = (
                f"{note}; {done}results.json could not be written ({err}): it holds only what was written "
                "before, without the summary; free space on its disk"
            ).lstrip("; ")
            log.error("could not write %s: %s", self.path, err)
        self.write_status()
        return self.data["final"]


def rounds_csv(data: dict) -> str:
    """One row per round, then one per node the round heard from (``client`` names it; empty in
    the round's row). A round's row: its own columns, then every round figure any round has, in
    the metric catalogue's order (``fedvlm.metrics``; the loop records no other). A node's row:
    its replies' figures as results.json's ``clients`` names them (``train/...``, ``eval/...``,
    bytes per message), and the epsilon a record of it has spent after the round (the ledger).
    A cell a row lacks is empty."""
    rounds = data["rounds"]
    privacy = data.get("privacy") or {}
    entries = privacy.get("rounds") or []
    present = {k for r in rounds for k in r["metrics"]}
    columns = [m for m in METRICS if m in present]
    node_columns = list(dict.fromkeys(k for r in rounds for c in (r.get("clients") or {}).values() for k in c))
    if entries:
        node_columns.append(NODE_EPSILON_COLUMN)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([ROUND_COLUMNS[0], CLIENT_COLUMN, *ROUND_COLUMNS[1:], *columns, *node_columns])
    blank_round, blank_node = [""] * (len(ROUND_COLUMNS) - 1 + len(columns)), [""] * len(node_columns)
    planned = privacy.get("spent") or {}  # a planned client no entry stated yet has spent nothing
    spent: dict[str, float] = {}  # the ledger's figures carried forward to the round written
    stated = iter(entries)
    pending = next(stated, None)
    for r in rounds:
        row = [*(r.get(c, "") for c in ROUND_COLUMNS[1:]), *(r["metrics"].get(c, "") for c in columns)]
        writer.writerow([r["round"], "", *row, *blank_node])
        while pending is not None and pending["round"] <= r["round"]:
            spent.update(round_changes(pending))
            pending = next(stated, None)
        for name, figures in sorted((r.get("clients") or {}).items()):
            epsilon = spent.get(name, 0.0 if name in planned else "")
            values = {**figures, NODE_EPSILON_COLUMN: epsilon}
            writer.writerow([r["round"], name, *blank_round, *(values.get(c, "") for c in node_columns)])
    return out.getvalue()


def traffic_text(figures: dict, scale: float, unit: str) -> str:
    """'train up U down D, evaluate up U down D <unit>' of a round's or a run's ``TRAFFIC_KEYS``."""
    each = [
        f"{purpose} up {figures[f'{purpose}_bytes_up'] / scale:,.{1 if scale > 1 else 0}f} "
        f"down {figures[f'{purpose}_bytes_down'] / scale:,.{1 if scale > 1 else 0}f}"
        for purpose in TRAFFIC
    ]
    return ", ".join(each) + f" {unit}"


def progress_line(record: dict, num_rounds: int) -> str:
    m = record["metrics"]
    parts = [f"[round {record['round']}/{num_rounds}]"]
    parts += [f"{x.label} {x.kind.show(m[x.name])}" for x in METRICS.values() if x.label and x.name in m]
    parts.append(f"{record['seconds']:.1f}s")
    parts.append(traffic_text(record, 1024, "KiB"))
    if record.get("dropped"):
        parts.append(f"{len(record['dropped'])} dropped")
    return " | ".join(parts)


def summary_table(data: dict) -> str:
    final = data["final"]
    rows = [
        ("method", data["config"]["method"]),
        ("dataset", data["config"]["dataset"]),
        ("rounds", str(final.get("rounds"))),
    ]
    for metric in METRICS.values():
        if metric.headline and metric.name in final:
            rows.append((f"{metric.name} (last round)", metric.kind.show(final[metric.name])))
            rows.append((f"{metric.name} (mean of last 10)", metric.kind.show(final[f"{metric.name}-last10-mean"])))
    rows.append(("traffic", traffic_text(final, 1, "bytes")))
    comm = data.get("communication") or {}
    if comm.get("up_vs_full_lora") is not None and comm.get("down_vs_full_lora") is not None:
        rows.append(
            (
                "training traffic vs full LoRA",
                f"up {comm['up_vs_full_lora']:.2f}x, down {comm['down_vs_full_lora']:.2f}x "
                f"({comm['train_bytes_up']:,} / {comm['train_bytes_down']:,} bytes vs "
                f"{comm['full_lora_bytes_up']:,} / {comm['full_lora_bytes_down']:,})",
            )
        )
    rows.append(("wall time", f"{final['seconds']:.1f}s"))
    width = max(len(k) for k, _ in rows)
    lines = ["-" * (width + 24)] + [f"{k.ljust(width)}  {v}" for k, v in rows] + ["-" * (width + 24)]
    return "\n".join(lines)
