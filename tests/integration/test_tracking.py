"""What a researcher sees of a run: the trackers read back through their own readers
(TensorBoard's event reader, MLflow's client against its SQLite store and against a real
``mlflow server``), rounds.csv's node rows against the ledger, and the pictures redrawn from the
run folder alone (``python -m fedvlm.plots``)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fedvlm.client_app.app import app as client_app
from fedvlm.metrics import EPSILON_SPENT
from fedvlm.protocol import FINAL_ROUND
from fedvlm.server_app.app import execute
from fedvlm.server_app.tracking import (
    ACCEPTED,
    HPARAMS_RUN,
    ROUND_FIGURES,
    RUN_FIGURE,
    SAMPLED,
    STATUS_TAG,
    VERDICT_TAG,
    round_values,
    run_figures,
)
from fedvlm.utils.files import json_text
from fedvlm.utils.inprocess import InProcessGrid
from fedvlm.utils.processes import free_port, kill_tree

pytest.importorskip("mlflow")  # the test extra installs both trackers (pyproject: fedvlm[tracking])
pytest.importorskip("tensorboard")

NODES = 3
DP = {"method": "dpfpl", "privacy.epsilon": 1.0, "privacy.audit-canaries": 40, "max-per-class": 6}


def _run(make_cfg, **overrides):
    cfg = make_cfg(**overrides)
    nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    return execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id=cfg.run_name).data, cfg


def _raw(**kv) -> dict:
    return {k.replace(".", "__").replace("-", "_"): v for k, v in kv.items()}


def _expected(data: dict) -> dict[int, dict[str, float]]:
    return {r["round"]: round_values(r) for r in data["rounds"]}


def _mlflow_history(client, run_id: str, names) -> dict[tuple[int, str], float]:
    """(round, name) -> the value MLflow holds; each logged once."""
    got: dict[tuple[int, str], float] = {}
    for name in names:
        for point in client.get_metric_history(run_id, name):
            assert (point.step, name) not in got, f"{name} logged twice at step {point.step}"
            got[point.step, name] = point.value
    return got


def _flat(expected: dict[int, dict[str, float]], names=None) -> dict[tuple[int, str], float]:
    return {(s, k): v for s, values in expected.items() for k, v in values.items() if names is None or k in names}


@pytest.mark.parametrize("every", [1, 2])  # evaluate-every 2: round 1 has training's figures only
def test_tensorboard_and_mlflow_hold_every_round_figure_the_config_and_the_run_folder(every, make_cfg, pretrained_clip):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    data, cfg = _run(
        make_cfg,
        **_raw(
            **DP,
            **{
                "num-server-rounds": 3,
                "evaluate-every": every,
                "run-name": f"tracked-{every}",
                "tracking.tensorboard": True,
                "tracking.mlflow": True,
            },
        ),
    )
    expected = _expected(data)
    names = sorted({k for v in expected.values() for k in v})
    assert {"epsilon/per-record-max", "epsilon/per-record-mean", "local-acc", SAMPLED, *ROUND_FIGURES} <= set(names)
    ledger = data["privacy"]["rounds"]
    stated: dict[str, float] = {}  # an entry names the nodes whose records spent since the one before
    for r, entry in zip(data["rounds"], ledger, strict=True):  # the mean is the ledger's, over the planned nodes
        stated.update(entry["changed"])
        per = [stated.get(name, 0.0) for name in data["privacy"]["records"]]
        assert r["metrics"]["epsilon/per-record-mean"] == pytest.approx(sum(per) / len(per))
        assert r["metrics"]["epsilon/per-record-max"] == pytest.approx(max(per))

    events = EventAccumulator(data["run"]["tracking"]["tensorboard"]["dir"])
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == names
    for name in names:
        points = {e.step: e.value for e in events.Scalars(name)}
        assert len(points) == len(events.Scalars(name)), f"{name} written twice for one round"
        assert points == pytest.approx({step: v[name] for step, v in expected.items() if name in v}, rel=1e-6)
    assert "config/text_summary" in events.Tags()["tensors"]

    info = data["run"]["tracking"]["mlflow"]
    assert info["uri"] == f"sqlite:///{Path(cfg.output_dir) / 'mlflow.db'}"
    client = MlflowClient(info["uri"])
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == f"tracked-{every}"
    assert [r["evaluated"] for r in data["rounds"]] == ([True] * 3 if every == 1 else [None, True, True])
    assert "local-acc" not in expected[1] if every == 2 else "local-acc" in expected[1]
    assert run.data.params == {k: str(v) for k, v in data["config"].items()}
    assert run.data.tags["method"] == "dpfpl" and run.data.tags["run_folder"] == str(
        Path(cfg.output_dir) / f"tracked-{every}"
    )
    assert _mlflow_history(client, info["run_id"], names) == pytest.approx(_flat(expected))
    artifacts = {a.path for a in client.list_artifacts(info["run_id"])}
    assert {"results.json", "rounds.csv", "privacy.png", "accuracy.png", "status.json"} <= artifacts
    # what a researcher sorts runs by: the run's summary, under names of its own, in both trackers
    summary = run_figures(data)
    assert summary[RUN_FIGURE + "local-acc-last10-mean"] == pytest.approx(data["final"]["local-acc-last10-mean"])
    assert summary[RUN_FIGURE + EPSILON_SPENT] == pytest.approx(data["privacy"]["rounds"][-1]["epsilon"])
    assert summary[RUN_FIGURE + EPSILON_SPENT] == pytest.approx(expected[max(expected)][EPSILON_SPENT])  # one name
    assert {k: v for k, v in run.data.metrics.items() if k.startswith(RUN_FIGURE)} == pytest.approx(summary)
    assert run.data.tags[VERDICT_TAG].startswith("finished 3 of 3 rounds")
    hparams = EventAccumulator(str(Path(data["run"]["tracking"]["tensorboard"]["dir"]) / HPARAMS_RUN))
    hparams.Reload()
    assert {k: hparams.Scalars(k)[-1].value for k in hparams.Tags()["scalars"]} == pytest.approx(summary, rel=1e-6)
    start = hparams.PluginTagToContent("hparams")["_hparams_/session_start_info"]  # the HParams view
    ended = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert ended[STATUS_TAG].string_value == "finished" and ended[ACCEPTED].number_value == 1
    assert ended[VERDICT_TAG].string_value == run.data.tags[VERDICT_TAG]
    # the local store keeps its artifacts beside it, not in the working directory
    assert (Path(cfg.output_dir) / "mlartifacts").is_dir()


def test_a_resumed_run_goes_on_with_its_mlflow_run_and_logs_each_round_once(make_cfg, pretrained_clip, tmp_path):
    from mlflow import MlflowClient

    common = {"method": "promptfl", "max-per-class": 6, "run-name": "grows", "tracking.mlflow": True}
    first, cfg = _run(make_cfg, **_raw(**common, **{"num-server-rounds": 2}))
    run_dir = Path(cfg.output_dir) / "grows"
    # resumed with another output-dir, whose default store would be another database: the run
    # goes on in the store it logged to
    moved = {"num-server-rounds": 3, "resume": str(run_dir), "output-dir": str(tmp_path / "elsewhere")}
    second, _ = _run(make_cfg, **_raw(**common, **moved))
    run_id = first["run"]["tracking"]["mlflow"]["run_id"]
    assert second["run"]["tracking"]["mlflow"] == first["run"]["tracking"]["mlflow"]
    client = MlflowClient(second["run"]["tracking"]["mlflow"]["uri"])
    expected = _expected(second)
    names = ["local-acc", "train_bytes_up"]
    got = _mlflow_history(client, run_id, names)
    assert sorted({step for step, _ in got}) == [1, 2, 3]
    assert got == pytest.approx(_flat(expected, names))
    assert client.get_run(run_id).info.status == "FINISHED"


class Killed(BaseException):
    """The server process dies here (a BaseException, so that no handler goes on after it)."""


def _kill_in_last_evaluation(req, reply):
    if req.metadata.message_type == "evaluate" and req.content["config"][FINAL_ROUND]:
        raise Killed
    return reply


def _tensorboard_points(tb_dir: str, names) -> dict[tuple[int, str], float]:
    """(round, name) -> the value TensorBoard shows; each shown once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_dir)
    events.Reload()
    got: dict[tuple[int, str], float] = {}
    for name in names:
        for e in events.Scalars(name):
            assert (e.step, name) not in got, f"{name} shown twice at step {e.step}"
            got[e.step, name] = e.value
    return got


def test_a_run_cut_off_in_its_last_evaluation_and_resumed_logs_each_figure_once(make_cfg, pretrained_clip):
    """The cut-off run logged its last round's training figures as it ended; the resumed run logs
    that round's evaluation and nothing twice, in both trackers, and MLflow's run goes from
    FAILED back to FINISHED."""
    from mlflow import MlflowClient

    same = {"method": "promptfl", "max-per-class": 6, "num-server-rounds": 2, "run-name": "cut"}
    same.update({"tracking.mlflow": True, "tracking.tensorboard": True})
    cfg = make_cfg(**_raw(**same))
    nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    with pytest.raises(Killed):
        execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=_kill_in_last_evaluation), run_id="a")
    run_dir = Path(cfg.output_dir) / "cut"
    cut = json.loads((run_dir / "results.json").read_text())
    info = cut["run"]["tracking"]["mlflow"]
    client = MlflowClient(info["uri"])
    assert client.get_run(info["run_id"]).info.status == "FAILED"
    assert [r["evaluated"] for r in cut["rounds"]] == [True, False]
    assert client.get_metric_history(info["run_id"], "train-loss")[-1].step == 2  # logged as the run ended

    later = make_cfg(**_raw(**same, resume=str(run_dir)))
    data = execute(later, InProcessGrid(client_app, nodes, later.as_dict()), run_id="b").data
    assert data["run"]["status"] == "finished" and data["run"]["tracking"]["mlflow"]["run_id"] == info["run_id"]
    expected = _flat(_expected(data))
    names = sorted({name for _, name in expected})
    assert "local-acc" in names and "train-loss" in names
    assert _mlflow_history(client, info["run_id"], names) == pytest.approx(expected)
    assert _tensorboard_points(data["run"]["tracking"]["tensorboard"]["dir"], names) == pytest.approx(expected)
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags[STATUS_TAG] == "finished"
    status = client.download_artifacts(info["run_id"], "status.json", str(run_dir.parent / "got"))
    assert json.loads(Path(status).read_text())["status"] == "finished"


def test_a_run_killed_outright_and_resumed_logs_its_owed_round_once(make_cfg, pretrained_clip, monkeypatch):
    """No ServerApp ended the killed run, so its owed round's training figures never reached the
    tracker: the resumed run logs them with the round's evaluation, each once."""
    from mlflow import MlflowClient

    from fedvlm.server_app.results import RunRecorder

    same = {"method": "promptfl", "max-per-class": 6, "num-server-rounds": 2, "run-name": "killed"}
    cfg = make_cfg(**_raw(**same, **{"tracking.mlflow": True}))
    nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    with monkeypatch.context() as m:
        m.setattr(RunRecorder, "finish", lambda self, *a, **k: None)  # the process dies: nothing is ended
        with pytest.raises(Killed):
            execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=_kill_in_last_evaluation), "a")
    run_dir = Path(cfg.output_dir) / "killed"
    later = make_cfg(**_raw(**same, **{"tracking.mlflow": True, "resume": str(run_dir)}))
    data = execute(later, InProcessGrid(client_app, nodes, later.as_dict()), run_id="b").data
    info = data["run"]["tracking"]["mlflow"]
    expected = _flat(_expected(data))
    names = sorted({name for _, name in expected})
    assert _mlflow_history(MlflowClient(info["uri"]), info["run_id"], names) == pytest.approx(expected)
    assert (2, "train-loss") in expected


def test_a_run_fedvlm_stop_ends_is_ended_in_its_trackers(make_cfg, pretrained_clip, monkeypatch):
    """A ServerApp killed outright ends nothing: its folder says 'running', and so does its MLflow
    run. ``fedvlm.stop`` records the interruption in both: the round still owed its evaluation
    logged, the folder's files attached, the run KILLED."""
    from mlflow import MlflowClient

    from fedvlm.server_app.results import RunRecorder
    from fedvlm.stop import record_interrupted

    same = {"method": "promptfl", "max-per-class": 6, "num-server-rounds": 2, "run-name": "gone"}
    cfg = make_cfg(**_raw(**same, **{"tracking.mlflow": True, "tracking.tensorboard": True}))
    nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    with monkeypatch.context() as m:
        m.setattr(RunRecorder, "finish", lambda self, *a, **k: None)  # the process dies: nothing is ended
        with pytest.raises(Killed):
            execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=_kill_in_last_evaluation), "a")
    run_dir = Path(cfg.output_dir) / "gone"
    left = json.loads((run_dir / "results.json").read_text())
    info = left["run"]["tracking"]["mlflow"]
    client = MlflowClient(info["uri"])
    assert left["run"]["status"] == "running" and client.get_run(info["run_id"]).info.status == "RUNNING"
    assert [p.step for p in client.get_metric_history(info["run_id"], "train-loss")] == [1]

    [line] = record_interrupted([run_dir])
    assert "interrupted after round 2" in line
    run = client.get_run(info["run_id"])
    assert run.info.status == "KILLED" and run.data.tags[STATUS_TAG] == "interrupted"
    assert [p.step for p in client.get_metric_history(info["run_id"], "train-loss")] == [1, 2]
    assert {"results.json", "status.json", "rounds.csv"} <= {a.path for a in client.list_artifacts(info["run_id"])}
    points = _tensorboard_points(left["run"]["tracking"]["tensorboard"]["dir"], ["train-loss"])
    assert sorted(points) == [(1, "train-loss"), (2, "train-loss")]


def test_a_real_mlflow_server_gets_the_run_and_a_dead_one_costs_a_warning_not_the_run(
    make_cfg, pretrained_clip, tmp_path
):
    """``mlflow server`` with a SQLite backend on loopback, started here and stopped by PID."""
    from mlflow import MlflowClient

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.time() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        data, _ = _run(
            make_cfg,
            **_raw(
                method="promptfl",
                **{"max-per-class": 6, "num-server-rounds": 2, "run-name": "served", "tracking.mlflow": True},
                **{"tracking.mlflow-uri": uri, "tracking.experiment": "lab"},
            ),
        )
        info = data["run"]["tracking"]["mlflow"]
        assert "failed" not in info and info["uri"] == uri
        client = MlflowClient(uri)
        assert client.get_experiment(info["experiment_id"]).name == "lab"
        got = _mlflow_history(client, info["run_id"], ["local-acc"])
        assert got == pytest.approx(_flat(_expected(data), ["local-acc"]))
        assert "results.json" in {a.path for a in client.list_artifacts(info["run_id"])}
    finally:
        kill_tree(server.pid)

    # the server is gone: the run finishes, says why it is untracked, and is not held up long
    t0 = time.time()
    data, cfg = _run(
        make_cfg,
        **_raw(
            method="promptfl",
            **{"max-per-class": 6, "num-server-rounds": 2, "run-name": "untracked", "tracking.mlflow": True},
            **{"tracking.mlflow-uri": uri},
        ),
    )
    assert data["run"]["status"] == "finished" and len(data["rounds"]) == 2
    assert data["run"]["tracking"]["mlflow"]["failed"].startswith("start: ")
    assert time.time() - t0 < 120
    on_disk = json.loads((Path(cfg.output_dir) / "untracked" / "results.json").read_text())
    assert on_disk["run"]["tracking"] == data["run"]["tracking"]


def test_rounds_csv_has_a_row_per_node_with_its_ledger_epsilon_and_the_plots_redraw_from_the_folder(
    make_cfg, pretrained_clip
):
    data, cfg = _run(make_cfg, **_raw(**DP, **{"num-server-rounds": 2, "run-name": "pictures"}))
    folder = Path(cfg.output_dir) / "pictures"
    # results.json, written with its per-node tables' entries kept between writes, is the data
    assert json.loads((folder / "results.json").read_text()) == json.loads(json_text(data))
    with open(folder / "rounds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["client"] for r in rows if r["round"] == "1"] == ["", "client-0", "client-1", "client-2"]
    stated: dict[str, float] = {}  # the ledger's entries name the clients that spent since the entry before
    spent_after = {}
    for entry in data["privacy"]["rounds"]:
        stated.update(entry["changed"])
        spent_after[entry["round"]] = dict(stated)
    for r in rows:
        record = data["rounds"][int(r["round"]) - 1]
        if r["client"] == "":
            assert float(r["local-acc"]) == pytest.approx(record["metrics"]["local-acc"]) and r["epsilon"] == ""
            continue
        spent = spent_after[int(r["round"])][r["client"]]
        assert float(r["epsilon"]) == pytest.approx(spent)
        assert float(r["eval/local-acc"]) == pytest.approx(record["clients"][r["client"]]["eval/local-acc"])
        assert r["local-acc"] == ""

    drawn = data["run"]["plots"]
    assert {"privacy.png", "accuracy.png"} <= set(drawn)
    assert "audit" in drawn["privacy.png"] and "target" in drawn["privacy.png"]
    # the ServerApp draws only what the run recorded: the split needs every node's data loaded
    assert "partition.png" not in drawn and not (folder / "partition.json").exists()

    for name in drawn:
        (folder / name).unlink()
    out = subprocess.run(
        [sys.executable, "-m", "fedvlm.plots", str(folder)], capture_output=True, text=True, check=True
    ).stdout
    redrawn = json.loads((folder / "results.json").read_text())["run"]["plots"]
    assert set(redrawn) == {*drawn, "partition.png"}
    for name in redrawn:
        assert (folder / name).stat().st_size > 10_000, name
        assert f"{folder / name}: " in out
    # the split the command counts is the one the nodes trained on (their handshakes' record
    # counts; the audited node's include its canaries)
    counts = json.loads((folder / "partition.json").read_text())
    audited = data["audit"]["nodes"]
    for node in data["run"]["nodes"]:
        canaries = audited[node["name"]]["canaries"] if node["name"] in audited else 0
        assert sum(counts["nodes"][node["name"]]["train"]) + canaries == node["num_train"]
        assert sum(counts["nodes"][node["name"]]["test"]) == node["num_test"]
    assert len(counts["names"]) == 40


def test_a_run_whose_nodes_bring_their_own_data_draws_no_partition():
    """A deployed node's label mix stays its own: the server neither asks for nor draws it."""
    from fedvlm.plots.partition import draw_partition

    data = {
        "config": {"method": "promptfl", "dataset": "embedded"},
        "run": {"nodes": [{"name": "h", "partition_id": -1}]},
    }
    assert draw_partition(data, Path("/nonexistent")) == {}


@pytest.mark.slow  # 22 s: a second real MLflow server; the first test keeps one in CI
def test_a_run_fedvlm_status_rejects_is_not_finished_in_mlflow(make_cfg, pretrained_clip):
    """A run that finished its rounds but heard from one of three sampled nodes in its last
    round: ``python -m fedvlm.status`` rejects it (code 4), and MLflow says FAILED with the reason,
    not FINISHED."""
    from mlflow import MlflowClient

    from fedvlm.status import LOST_NODES, check

    cfg = make_cfg(**_raw(method="promptfl", **{"max-per-class": 6, "num-server-rounds": 2, "tracking.mlflow": True}))
    nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]

    def lose_two(req, reply):  # the last round's training replies of two nodes never arrive
        config = req.content.get("config")
        late = config is not None and int(config.get("server-round", 0)) == 2
        return None if late and req.metadata.message_type == "train" and req.metadata.dst_node_id > 1000 else reply

    rec = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=lose_two), run_id="lost")
    data = rec.data
    assert data["run"]["status"] == "finished"
    assert check(rec.dir).code == LOST_NODES
    info = data["run"]["tracking"]["mlflow"]
    run = MlflowClient(info["uri"]).get_run(info["run_id"])
    assert run.info.status == "FAILED" and run.data.tags[STATUS_TAG] == "finished"
    assert "round 2 lost 2 of 3" in run.data.tags[VERDICT_TAG]
