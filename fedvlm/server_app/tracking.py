"""Experiment trackers: a run's figures in the TensorBoard or MLflow a lab already runs.

``tracking.tensorboard`` writes event files into the run folder's ``tensorboard/`` (through torch's
``SummaryWriter``, which writes TensorBoard's own format); ``tracking.mlflow`` logs to any MLflow
tracking URI through MLflow's client. Both get, as a round's figures are complete (its
evaluation back, or the run over), every round figure the run records (``fedvlm.metrics``: the
ledger's epsilon max and mean over the nodes among them), the round's bytes, seconds and sampled
nodes, under the round as step; the validated config at the start (MLflow's parameters,
TensorBoard's text); and at the end the run folder's results.json, rounds.csv, the plots and
the ledger (MLflow's artifacts).

A tracker never fails a run: its first error (a server that is down, a disk that is full) is
logged as a warning and recorded in results.json's ``run.tracking``, and that tracker is dropped
for the rest of the run. MLflow's client is held to ``HTTP_TIMEOUT_S`` and ``HTTP_RETRIES``
(unless the environment sets MLflow's own variables), so a dead server costs seconds, not the
minutes of its default retries. A resumed run goes on with the same MLflow run in the store it
was logged to (its URI and id are in ``run.tracking``) and logs only what the interrupted run did
not (TensorBoard also hides anything logged past the round it resumes from; docs/outputs.md says
when MLflow can hold a round twice). A run ``fedvlm.stop`` ended is finished in its
trackers as the ServerApp would have (``Trackers.reattached``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from fedvlm.metrics import EPSILON_SPENT
from fedvlm.runconfig import RunConfig
from fedvlm.status import MAX_LOST, OK, verdict
from fedvlm.strategies.records import TRAFFIC_KEYS, complete

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
HPARAMS_RUN = "hparams"  # the TensorBoard run (a folder under tensorboard/) holding the config and summary
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"
HTTP_TIMEOUT_S, HTTP_RETRIES = "10", "1"
# a round's own figures, beside its declared metrics
# a round's own figures beside its declared metrics, under rounds.csv's names (one name per quantity)
ROUND_FIGURES = ("seconds", *TRAFFIC_KEYS)
SAMPLED = "sampled"
FILES = ("results.json", "rounds.csv", "partition.json", "status.json")  # and every *.png
PARAM_CHUNK = 100  # MLflow takes at most 100 parameters per batch
INSTALL = "pip install 'fedvlm[tracking]'"
# a run the privacy budget stopped before its rounds ended short of them on purpose: KILLED, as
# MLflow has no status for it, never FINISHED (``python -m fedvlm.status`` exits 3 for it)
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "interrupted": "KILLED"}  # else FAILED
STATUS_TAG, NOTE_TAG = "ended", "note"  # how the run ended, in fedvlm's words
VERDICT_TAG = "verdict"  # what python -m fedvlm.status says of the run as it ends
ACCEPTED = "accepted"  # TensorBoard hparams: 1 where fedvlm.status accepts the run (MLflow: FINISHED), else 0
RUN_FIGURE = "run/"  # a run-level summary figure (results.json's final) beside the per-round ones


def run_figures(data: dict) -> dict[str, float]:
    """What a researcher sorts runs by: results.json's ``final`` (the headline figures' last
    round and mean of the last 10, the traffic totals) and the epsilon a record spent (the ledger's
    last, under the rounds' name for it), each under ``run/``, a name of its own (a run's total is
    not a round's figure)."""
    final = {k: v for k, v in (data.get("final") or {}).items() if isinstance(v, (int, float))}
    spent = ((data.get("privacy") or {}).get("rounds") or [{}])[-1].get("epsilon")
    if spent is not None:
        final[EPSILON_SPENT] = spent
    return {RUN_FIGURE + k: float(v) for k, v in final.items() if not isinstance(v, bool)}


def ended_as(data: dict) -> tuple[str, str]:
    """(MLflow's status, the verdict) of a run as it ends: a run ``fedvlm.status`` rejects is never
    FINISHED: one that finished but lost most of its last round's clients is FAILED, one its
    privacy budget stopped early KILLED."""
    found = verdict(data, MAX_LOST, 0.0, alive=True)
    status = data["run"]["status"]
    state = MLFLOW_STATUS.get(status, "FAILED")
    if status == "finished" and found.code != OK:
        state = "FAILED"
    return state, found.reason


def round_values(record: dict) -> dict[str, float]:
    """What a tracker logs of a round's record: its figures, bytes, seconds and sampled nodes."""
    values = {k: float(v) for k, v in record["metrics"].items() if isinstance(v, (int, float))}
    values.update({name: float(record[name]) for name in ROUND_FIGURES if name in record})
    if "sampled" in record:
        values[SAMPLED] = float(record["sampled"])
    return values


def settled_values(record: dict) -> dict[str, float]:
    """What of a round's record no later message changes: all of it once the round is complete;
    before, not its bytes and seconds, which its evaluation adds to."""
    values = round_values(record)
    if not complete(record):
        values = {k: v for k, v in values.items() if k not in ROUND_FIGURES}
    return values


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError(f"tracking.tensorboard needs the tensorboard package: {INSTALL}") from err
        self.dir = run_dir / TENSORBOARD_DIR
        self.make_writer = SummaryWriter
        self.writer: Any = None

    def start(self, data: dict, resumed: bool) -> dict:
        # a resumed run hides what the interrupted one logged past the round it goes on from
        # (a round recorded after its checkpoint is run again)
        kept = max((r["round"] for r in data["rounds"]), default=0)
        self.writer = self.make_writer(log_dir=str(self.dir), purge_step=kept + 1 if resumed else None)
        if not resumed:
            rows = "\n".join(f"| {k} | {v} |" for k, v in data["config"].items())
            self.writer.add_text("config", "| key | value |\n|---|---|\n" + rows)
        return {"dir": str(self.dir)}

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def finish(self, data: dict, run_dir: Path) -> None:
        """The run's config, how it ended (its status, ``fedvlm.status``'s reason, and whether that
        accepts it: the column a rejected run is filtered out by) and summary figures in TensorBoard's HParams view
        (its ``hparams`` run)."""
        if self.writer is None:
            return
        params = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in data["config"].items()}
        state, reason = ended_as(data)
        params |= {STATUS_TAG: data["run"]["status"], VERDICT_TAG: reason[:500], ACCEPTED: int(state == "FINISHED")}
        self.writer.add_hparams(params, run_figures(data), run_name=HPARAMS_RUN)
        self.writer.close()


class MLflow:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, output_dir: str, run_dir: Path):
        self.run_dir, self.experiment, self.output_dir = run_dir, experiment, output_dir
        for var, value in (
            ("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S),
            ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_RETRIES),
        ):
            os.environ.setdefault(var, value)
        try:
            from mlflow import MlflowClient
        except ImportError as err:
            raise RuntimeError(f"tracking.mlflow needs the mlflow package: {INSTALL}") from err
        self.make_client = MlflowClient
        self.local = not (uri or os.environ.get("MLFLOW_TRACKING_URI"))
        self.uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(output_dir) / MLFLOW_DB}"
        self.client: Any = None
        self.experiment_id = self.run_id = ""

    def start(self, data: dict, resumed: bool) -> dict:
        from mlflow.entities import Param, RunTag

        known = ((data["run"].get("tracking") or {}).get(self.name) or {}) if resumed else {}
        if known.get("run_id"):  # the same run, in the store it was logged to (output-dir may have moved)
            self.uri, self.experiment_id, self.run_id = known["uri"], known["experiment_id"], known["run_id"]
            self.client = self.make_client(tracking_uri=self.uri)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.client = self.make_client(tracking_uri=self.uri)
            found = self.client.get_experiment_by_name(self.experiment)
            if found is not None:
                self.experiment_id = found.experiment_id
            else:  # a local store keeps its artifacts beside it, not in the working directory
                where = (Path(self.output_dir) / MLFLOW_ARTIFACTS).as_uri() if self.local else None
                self.experiment_id = self.client.create_experiment(self.experiment, artifact_location=where)
            run = data["run"]
            tags = {
                "mlflow.runName": self.run_dir.name,
                "method": str(run.get("method", "")),
                "family": str(run.get("family", "")),
                "dataset": str(data["config"].get("dataset", "")),
                "run_folder": str(self.run_dir),
            }
            self.run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in data["config"].items()]
            for i in range(0, len(params), PARAM_CHUNK):
                self.client.log_batch(self.run_id, params=params[i : i + PARAM_CHUNK])
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items() if k != "mlflow.runName"])
        return {"uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def finish(self, data: dict, run_dir: Path) -> None:
        for path in [*(run_dir / f for f in FILES), *sorted(run_dir.glob("*.png"))]:
            if path.exists():
                self.client.log_artifact(self.run_id, str(path))
        from mlflow.entities import Metric, RunTag

        run, (state, reason) = data["run"], ended_as(data)
        now, step = int(time.time() * 1000), len(data["rounds"])
        summary = [Metric(k, v, now, step) for k, v in run_figures(data).items()]
        ended = [
            RunTag(STATUS_TAG, run["status"]),
            RunTag(NOTE_TAG, str(run.get("note", ""))[:5000]),
            RunTag(VERDICT_TAG, reason[:5000]),
        ]
        self.client.log_batch(self.run_id, metrics=summary, tags=ended)
        self.client.set_terminated(self.run_id, state)


class Trackers:
    """The run's trackers. Every call into one is guarded: its first error drops it (``failed``)."""

    def __init__(self, make: list[tuple[str, Any]]):
        self.make = make  # (name, a callable building the tracker): built at ``start``
        self.live: list[Any] = []
        self.info: dict[str, dict] = {}
        self.logged: dict[int, set[str]] = {}  # round -> names already logged
        self.settled = 0  # the rounds before this index are evaluated and logged: never looked at again

    @classmethod
    def of(cls, cfg: RunConfig, run_dir: Path) -> Trackers:
        """The trackers a run config asks for (``cfg.tracking``)."""
        t = cfg.tracking
        make: list[tuple[str, Any]] = []
        if t.tensorboard:
            make.append((TensorBoard.name, lambda: TensorBoard(run_dir)))
        if t.mlflow:
            make.append((MLflow.name, lambda: MLflow(t.mlflow_uri, t.experiment, cfg.output_dir, run_dir)))
        return cls(make)

    def _fail(self, name: str, tracker: Any, what: str, err: BaseException) -> None:
        log.warning("tracker %s failed (%s): %s: %s; the run goes on without it", name, what, type(err).__name__, err)
        self.info[name] = {**self.info.get(name, {}), "failed": f"{what}: {type(err).__name__}: {str(err)[:300]}"}
        if tracker in self.live:
            self.live.remove(tracker)

    @classmethod
    def reattached(cls, data: dict, run_dir: Path) -> Trackers:
        """The trackers a run folder's ``run.tracking`` says its run was sending to (those that had
        not failed), to finish them for a ServerApp that ended without doing so (``fedvlm.stop``)."""
        info = data["run"].get("tracking") or {}
        tensorboard, mlflow = info.get(TensorBoard.name) or {}, info.get(MLflow.name) or {}
        make: list[tuple[str, Any]] = []
        if "dir" in tensorboard and "failed" not in tensorboard:
            make.append((TensorBoard.name, lambda: TensorBoard(run_dir)))
        if "run_id" in mlflow and "failed" not in mlflow:
            output = str(data["config"].get("output-dir", ""))
            make.append((MLflow.name, lambda: MLflow(mlflow["uri"], "", output, run_dir)))
        return cls(make)

    def start(self, data: dict, resumed: bool, ended: bool = True) -> dict[str, dict]:
        """Build and start every tracker; what results.json's ``run.tracking`` records. ``resumed``:
        going on with a run that logged to them before, whose ServerApp ``ended`` it (``finish``)
        or did not (a folder ``fedvlm.stop`` ends)."""
        if resumed:
            # a complete round was logged as it completed, and what was settled of the one still
            # owed its evaluation when the run ended; the rest of it is logged as it completes. A run
            # killed outright never ended: its owed round's training figures are in results.json,
            # not in the tracker.
            self.logged = {r["round"]: set(settled_values(r)) for r in data["rounds"] if ended or complete(r)}
            # what the trackers it still has recorded (their run ids, kept if one fails now)
            mine = {name for name, _ in self.make}
            self.info = {k: dict(v) for k, v in (data["run"].get("tracking") or {}).items() if k in mine}
        for name, build in self.make:
            tracker = None
            try:
                tracker = build()
                self.live.append(tracker)
                self.info[name] = tracker.start(data, resumed)
            except Exception as err:  # noqa: BLE001 - a tracker never fails the run
                self._fail(name, tracker, "start", err)
        return dict(self.info)

    def update(self, data: dict, final: bool = False) -> None:
        """Log every figure of a complete round not logged yet; at the run's end (``final``), what
        is settled of a round still owed its evaluation too."""
        if not self.live:
            return
        rounds = data["rounds"]
        for record in rounds[self.settled :]:
            step = record["round"]
            done = self.logged.setdefault(step, set())
            if not (complete(record) or final):
                continue
            fresh = {k: v for k, v in settled_values(record).items() if k not in done}
            if not fresh:
                continue
            for tracker in list(self.live):
                try:
                    tracker.log(step, fresh)
                except Exception as err:  # noqa: BLE001
                    self._fail(tracker.name, tracker, f"round {step}", err)
            done.update(fresh)
        while self.settled < len(rounds) and complete(rounds[self.settled]):
            self.settled += 1

    def finish(self, data: dict, run_dir: Path) -> dict[str, dict]:
        """The last figures, the run folder's files, and how the run ended."""
        self.update(data, final=True)
        for tracker in list(self.live):
            try:
                tracker.finish(data, run_dir)
            except Exception as err:  # noqa: BLE001
                self._fail(tracker.name, tracker, "finish", err)
        return dict(self.info)
