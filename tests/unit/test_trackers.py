"""A tracker never fails a run: one that breaks while logging a round, or at the end, or whose
package is missing, is dropped with its reason recorded, and the others go on; and only a run
``fedvlm.status`` accepts ends FINISHED in one."""

from __future__ import annotations

import sys

import pytest

from fedvlm.metrics import TRAIN_CLIENTS
from fedvlm.server_app.tracking import INSTALL, TensorBoard, Trackers, ended_as
from fedvlm.status import OK, verdict


class Recording:
    name = "recording"

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []
        self.finished = False

    def start(self, data, resumed):
        return {"kind": "recording"}

    def log(self, step, values):
        self.logged.append((step, values))

    def finish(self, data, run_dir):
        self.finished = True


class Breaks(Recording):
    def __init__(self, where: str):
        super().__init__()
        self.name, self.where = f"breaks-in-{where}", where

    def log(self, step, values):
        if self.where == "log":
            raise ConnectionError("the server went away")
        super().log(step, values)

    def finish(self, data, run_dir):
        if self.where == "finish":
            raise OSError("disk full")
        super().finish(data, run_dir)


def _round(n: int) -> dict:
    return {"round": n, "evaluated": True, "metrics": {"local-acc": 0.5}, "seconds": 1.0, "sampled": 3}


def test_a_tracker_that_breaks_is_dropped_and_the_others_go_on(tmp_path):
    good, in_log, in_finish = Recording(), Breaks("log"), Breaks("finish")
    trackers = Trackers([(t.name, lambda t=t: t) for t in (good, in_log, in_finish)])
    data = {"run": {}, "config": {}, "rounds": [_round(1)]}
    trackers.start(data, resumed=False)
    trackers.update(data)
    data["rounds"].append(_round(2))
    trackers.update(data)
    info = trackers.finish(data, tmp_path)
    assert [step for step, _ in good.logged] == [1, 2] and good.finished
    assert info["breaks-in-log"]["failed"] == "round 1: ConnectionError: the server went away"
    assert [step for step, _ in in_finish.logged] == [1, 2]  # it logged every round before it broke
    assert info["breaks-in-finish"]["failed"] == "finish: OSError: disk full"
    assert info["recording"] == {"kind": "recording"}


def test_a_missing_tracker_package_costs_the_tracker_and_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    trackers = Trackers([(TensorBoard.name, lambda: TensorBoard(tmp_path))])
    info = trackers.start({"run": {}, "config": {}, "rounds": []}, resumed=False)
    assert info["tensorboard"]["failed"].startswith("start: RuntimeError: tracking.tensorboard needs")
    assert INSTALL in info["tensorboard"]["failed"] and not trackers.live


@pytest.mark.parametrize(
    ("status", "tracked"),
    [("finished", "FINISHED"), ("stopped", "KILLED"), ("interrupted", "KILLED"), ("failed", "FAILED")],
)
def test_only_a_run_fedvlm_status_accepts_ends_finished_in_the_tracker(status, tracked):
    """Issue 62: a run the privacy budget stopped early (``fedvlm.status`` exits 3) was FINISHED in
    MLflow, beside the runs that did all their rounds."""
    rounds = [{"round": 1, "sampled": 2, "metrics": {TRAIN_CLIENTS: 2}}]
    data = {"config": {"num-server-rounds": 3}, "run": {"status": status, "note": "why"}, "rounds": rounds}
    state, reason = ended_as(data)
    assert state == tracked and reason == verdict(data, 0.5, 0.0, alive=True).reason
    assert (state == "FINISHED") == (verdict(data, 0.5, 0.0, alive=True).code == OK)
