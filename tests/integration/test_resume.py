"""Exact resume: a run killed in round k and resumed from its run folder ends with the numbers,
privacy ledger, shared arrays and published node prompts of an uninterrupted run
(server_app.resume, client_app.state); a resume that cannot be exact is refused."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from fedvlm.client_app.app import app as client_app
from fedvlm.protocol import FINAL_ROUND, SERVER_ROUND
from fedvlm.server_app.app import execute
from fedvlm.strategies.base import ResumeError
from fedvlm.utils.files import UnreadableFile, atomic_torch_save, load_saved
from fedvlm.utils.inprocess import InProcessGrid


class Killed(BaseException):
    """The server process dies here (a BaseException, so that no handler goes on after it)."""


def _kill_in_round(k: int):
    """Kill the server when the first train reply of round ``k`` arrives: that node has trained
    and written its state for round k; the round never completes."""

    def intercept(req, reply):
        if req.metadata.message_type == "train" and int(req.content["config"][SERVER_ROUND]) == k:
            raise Killed
        return reply

    return intercept


def _grid(cfg, nodes, intercept=None):
    # a new grid is a new set of node processes: nothing in memory from the killed run
    return InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=intercept)


def _partitions(n):
    return [{"partition-id": i, "num-partitions": n} for i in range(n)]


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _whole_and_resumed(make_cfg, nodes, kill_round, **overrides):
    whole_cfg = make_cfg(run_name="whole", **overrides)
    whole = execute(whole_cfg, _grid(whole_cfg, nodes), run_id="whole")
    cfg = make_cfg(run_name="interrupted", **overrides)
    with pytest.raises(Killed):
        execute(cfg, _grid(cfg, nodes, _kill_in_round(kill_round)), run_id="first")
    killed = json.loads((whole.dir.parent / "interrupted" / "results.json").read_text())
    assert killed["run"]["status"] == "failed" and len(killed["rounds"]) == kill_round - 1
    resumed_cfg = make_cfg(resume=str(whole.dir.parent / "interrupted"), **overrides)
    return whole, execute(resumed_cfg, _grid(resumed_cfg, nodes), run_id="second")


def _assert_same_run(a, b):
    da, db = json.loads(a.path.read_text()), json.loads(b.path.read_text())
    assert [r["round"] for r in db["rounds"]] == [r["round"] for r in da["rounds"]]
    for ra, rb in zip(da["rounds"], db["rounds"], strict=True):
        assert _untimed(ra) == _untimed(rb), f"round {ra['round']} differs"
    assert _untimed(da.get("privacy")) == _untimed(db.get("privacy"))
    assert (da["run"]["status"], da["run"].get("note")) == (db["run"]["status"], db["run"].get("note"))
    fa, fb = (torch.load(r.dir / "final_shared.pt", weights_only=True)["arrays"] for r in (a, b))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    # the nodes' private state came back: what they publish at the end is bit for bit the same
    pa, pb = sorted((a.dir / "published").glob("*.pt")), sorted((b.dir / "published").glob("*.pt"))
    assert [p.name for p in pa] == [p.name for p in pb]
    for x, y in zip(pa, pb, strict=True):
        px, py = (torch.load(p, weights_only=True)["prompts"] for p in (x, y))
        assert px.keys() == py.keys() and all(torch.equal(px[k], py[k]) for k in px), x.name
    assert db["run"]["resumed"][0]["run_id"] == "second"


@pytest.mark.parametrize(
    "overrides",
    [
        {"method": "promptfl"},
        # the server optimiser's moments, the spent budget and the ledger; the budget stops it
        # after round 3 of 5 in both runs
        {
            "method": "dpfpl",
            "privacy__noise_multiplier": 1.0,
            "privacy__max_epsilon": 3.55,
            "num_server_rounds": 5,
        },
        pytest.param({"method": "pfedmoap", "pfedmoap__k": 1}, marks=pytest.mark.slow),
    ],
    ids=["promptfl", "dpfpl-dp-budget-stop", "pfedmoap"],
)
def test_a_killed_run_resumes_to_the_uninterrupted_numbers(make_cfg, pretrained_clip, overrides):
    overrides = {"num_server_rounds": 3, **overrides}
    whole, resumed = _whole_and_resumed(make_cfg, _partitions(3), kill_round=2, **overrides)
    _assert_same_run(whole, resumed)
    if "privacy__max_epsilon" in overrides:
        assert resumed.data["run"]["status"] == "stopped" and len(resumed.data["rounds"]) == 3
        assert resumed.data["privacy"]["rounds"][-1]["epsilon"] <= overrides["privacy__max_epsilon"]
        # round 2 was cut off after its train messages went out; with seeded noise its rerun is
        # the same release, spent once (which is why the ledgers above agree)
        entry = resumed.data["run"]["resumed"][0]
        assert (entry["from_round"], entry["abandoned_round"], entry["charged"]) == (1, 2, False)


def test_a_run_cut_off_in_its_last_evaluation_resumes_to_finish_it(make_cfg, pretrained_clip):
    """The last round's evaluation goes out after its checkpoint: a run killed in it is resumed to
    send it again, and ends as the uninterrupted run (figures, published prompts)."""

    def kill_in_last_evaluation(req, reply):
        if req.metadata.message_type == "evaluate" and req.content["config"][FINAL_ROUND]:
            raise Killed
        return reply

    same = {"method": "promptfl", "num_server_rounds": 2}
    whole_cfg = make_cfg(run_name="whole", **same)
    whole = execute(whole_cfg, _grid(whole_cfg, _partitions(3)), run_id="whole")
    cfg = make_cfg(run_name="cut", **same)
    with pytest.raises(Killed):
        execute(cfg, _grid(cfg, _partitions(3), kill_in_last_evaluation), run_id="first")
    killed = json.loads((whole.dir.parent / "cut" / "results.json").read_text())
    assert [r["evaluated"] for r in killed["rounds"]] == [True, False]
    assert "eval-clients" not in killed["rounds"][-1]["metrics"]
    later = make_cfg(resume=str(whole.dir.parent / "cut"), **same)
    resumed = execute(later, _grid(later, _partitions(3)), run_id="second")
    _assert_same_run(whole, resumed)
    assert resumed.data["run"]["resumed"][0]["from_round"] == 2


def test_reprogram_under_dp_resumes_with_the_nodes_accountants(make_cfg, cache_dir):
    whole, resumed = _whole_and_resumed(
        make_cfg,
        _partitions(3),
        kill_round=2,
        method="reprogram",
        dataset="digits",  # the tiny source: the motif one needs minutes of pretraining
        num_server_rounds=3,
        reprogram__local_iterations=2,
    )
    _assert_same_run(whole, resumed)
    # the nodes' own Opacus accountants went on from their saved state: the epsilon they report
    # in the last round is the uninterrupted run's
    assert (
        resumed.data["privacy"]["rounds"][-1]["client_reported"]
        == whole.data["privacy"]["rounds"][-1]["client_reported"]
    )
    assert (
        resumed.data["privacy"]["client_reported"] == whole.data["privacy"]["client_reported"]
        and resumed.data["privacy"]["spent"] == whole.data["privacy"]["spent"]
    )


def test_deployed_nodes_keep_their_state_in_their_own_state_dir(make_cfg, pretrained_clip, tmp_path):
    from fedvlm.deploy.export_folder import export_partitions

    folders = export_partitions(tmp_path / "orgs", 2)
    # seeded batches (an organisation's node draws them from the OS by default) for exact numbers
    nodes = [
        {"data-dir": str(f), "state-dir": str(tmp_path / "state" / f.name), "noise-source": "seeded"} for f in folders
    ]
    whole, resumed = _whole_and_resumed(make_cfg, nodes, kill_round=2, method="coop", num_server_rounds=3)
    # coop's prompts never leave the nodes; each node published its own to its run's folder
    _assert_same_run(whole, resumed)
    assert not (resumed.dir / "nodes").exists()  # nothing of a node's state under the server's folder
    for f in folders:
        # the run's folder in the node's state-dir: one component named from the server's run folder
        (where,) = [d / f.name for d in (tmp_path / "state" / f.name).glob("interrupted-*")]
        snapshots = sorted(p.name for p in where.iterdir())
        assert snapshots == ["round-0002.pt", "round-0003.pt"]
        assert stat.S_IMODE(where.stat().st_mode) == 0o700
        assert all(stat.S_IMODE((where / s).stat().st_mode) == 0o600 for s in snapshots)
        saved = torch.load(where / "round-0003.pt", weights_only=True)["records"]
        assert "local_ctx" in saved["private"][1] or saved["private"][1]  # the private prompt is there


@pytest.mark.slow
def test_fedrand_resumes_with_each_clients_private_half(make_cfg, vlm_cache):
    whole, resumed = _whole_and_resumed(
        make_cfg,
        _partitions(4),
        kill_round=2,
        method="fedrand",
        num_server_rounds=3,
        fraction_train=0.5,
        lora__local_steps=3,
        vlm__eval_samples=4,
        vlm__max_new_tokens=16,
    )
    # every client's own model (with the half it never shared) scores as in the uninterrupted run
    _assert_same_run(whole, resumed)
    assert "client-cider" in resumed.data["rounds"][-1]["metrics"]
    kept = sorted(p.name for p in (whole.dir / "reconstructed").glob("*.pt"))
    assert kept == sorted(p.name for p in (resumed.dir / "reconstructed").glob("*.pt")) and kept
    for name in kept:
        a, b = (torch.load(r.dir / "reconstructed" / name, weights_only=True)["arrays"] for r in (whole, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_round_abandoned_with_os_noise_is_charged_again(make_cfg, pretrained_clip):
    same = {"method": "promptfl", "num_server_rounds": 3, "max_per_class": 6}
    same |= {"privacy__noise_multiplier": 1.0, "privacy__noise_source": "os"}
    cfg = make_cfg(run_name="os", **same)
    with pytest.raises(Killed):
        execute(cfg, _grid(cfg, _partitions(2), _kill_in_round(2)), run_id="first")
    later = make_cfg(resume=str(cfg.output_dir + "/os"), **same)
    resumed = execute(later, _grid(later, _partitions(2)), run_id="second")
    assert resumed.data["run"]["resumed"][0]["charged"] is True
    # each record has now been released in four rounds: 1, the abandoned 2, its rerun, and 3
    ledger = resumed.data["privacy"]
    account = {c: r["planned_epsilon"] for c, r in ledger["records"].items()}
    spent = ledger["spent"]
    from fedvlm.privacy.accounting import GaussianReleases, epsilon_spent

    for client, row in ledger["records"].items():
        four = epsilon_spent(GaussianReleases(row["z_local"], 4 * row["steps_per_round"], row["sampling_rate"]), 1e-5)
        assert spent[client] == pytest.approx(four, rel=1e-9) and spent[client] > account[client]


def test_resuming_refuses_what_it_cannot_continue_exactly(make_cfg, pretrained_clip, tmp_path):
    nodes = _partitions(2)
    cfg = make_cfg(method="dpfpl", run_name="done", num_server_rounds=1, privacy__epsilon=2.0)
    done = execute(cfg, _grid(cfg, nodes), run_id="a").dir

    with pytest.raises(ResumeError, match=r"differs from this one in 2 key\(s\): prompt.lr = .*seed = 0 \(now 1\)"):
        execute(make_cfg(resume=str(done), prompt__lr=0.5, seed=1, method="dpfpl", privacy__epsilon=2.0), None, "b")
    same = {"method": "dpfpl", "privacy__epsilon": 2.0}
    with pytest.raises(ResumeError, match="completed 1 round.*raise num-server-rounds"):
        execute(make_cfg(resume=str(done), num_server_rounds=1, **same), None, "b")
    with pytest.raises(ResumeError, match="does not exist"):
        execute(make_cfg(resume=str(tmp_path / "nowhere"), **same), None, "b")
    # with a target epsilon, more rounds would have meant more noise from round 1: refused
    longer = make_cfg(resume=str(done), num_server_rounds=3, **same)
    with pytest.raises(ResumeError, match="other noise than the interrupted run.*noise-multiplier"):
        execute(longer, _grid(longer, nodes), run_id="b")
    after = json.loads((done / "results.json").read_text())  # every refusal left the run as it was
    assert after["run"]["status"] == "finished" and len(after["rounds"]) == 1 and "resumed" not in after["run"]
    # ... and says so beside it: `flwr run ... resume=... && python -m fedvlm.status` fails (it said
    # "finished 1 of 1 rounds" and exited 0 when the resume was refused)
    from fedvlm.status import FAILED, check

    refused = check(done)
    assert refused.code == FAILED and "a resume was refused" in refused.reason and "noise-multiplier" in refused.reason
    assert "(the run itself: finished 1 of 1 rounds" in refused.reason
    # records a run does not write (a round in flight that is not one, a round that is not an
    # object) are refused by name and noted, not a TypeError that left status saying 'finished'
    original = (done / "results.json").read_text()
    for body in ('{"round": "25", "trainees": []}', '{"round": 2, "trainees": [1]}', "[2]"):
        (done / "inflight.json").write_text(body)
        with pytest.raises(ResumeError, match=r"inflight\.json is not a round in flight"):
            execute(make_cfg(resume=str(done), num_server_rounds=2, **same), None, "b")
        assert check(done).code == FAILED
    (done / "inflight.json").unlink()
    for rounds, words in (([1], r"rounds\[0\] is not an object"), ([{"round": "1"}], "is not a whole number")):
        (done / "results.json").write_text(json.dumps({**json.loads(original), "rounds": rounds}))
        with pytest.raises(ResumeError, match=words):
            execute(make_cfg(resume=str(done), num_server_rounds=2, **same), None, "b")
    (done / "results.json").write_text(original)
    # a run that began on other weights (its embedded default pretrained on another CPU) is not continued on these
    checkpoint = done / "checkpoint.pt"
    saved = load_saved(checkpoint, "")
    other = {**saved["state"], "backbone": "embedded-tiny:gelu:sha256:0"}
    atomic_torch_save({**saved, "state": other}, checkpoint, digest=True)
    with pytest.raises(ResumeError, match="began on backbone weights embedded-tiny:gelu:sha256:0 and this server"):
        again = make_cfg(resume=str(done), num_server_rounds=2, **same)
        execute(again, _grid(again, nodes), "b")
    assert json.loads((done / "results.json").read_text())["run"]["status"] == "finished"
    # a resume pinned to weights the run did not begin on is refused before anything is recorded
    # (the pin may be added at a resume: it computes nothing), naming what the run began on
    with pytest.raises(ResumeError, match=r"began on weights embedded-tiny:gelu:sha256:0, not the pinned 'ffff"):
        execute(
            make_cfg(resume=str(done), num_server_rounds=2, backbone_fingerprint="ffff0000ffff0000", **same), None, "b"
        )
    assert json.loads((done / "results.json").read_text())["run"]["status"] == "finished"
    # a damaged checkpoint is named, with what to do, instead of torch's unpickling error
    checkpoint.write_bytes(checkpoint.read_bytes()[:200])
    with pytest.raises(UnreadableFile, match=r"checkpoint\.pt cannot be read.*restore it from a backup"):
        execute(make_cfg(resume=str(done), num_server_rounds=2, **same), None, "b")
    # so is a damaged results.json (a bare JSONDecodeError named neither)
    (done / "results.json").write_bytes(b'{"run": \xff')
    with pytest.raises(UnreadableFile, match=r"results\.json is not valid UTF-8 JSON.*cannot be resumed"):
        execute(make_cfg(resume=str(done), num_server_rounds=2, **same), None, "b")
    # ... and one that is JSON but not a run's record (a bare TypeError/KeyError named neither)
    for body, words in (("[]", "holds a JSON list, not a run's record"), ('{"run": {}}', "'config' is missing")):
        (done / "results.json").write_text(body)
        with pytest.raises(UnreadableFile, match=f"results\\.json.*{words}.*cannot be resumed"):
            execute(make_cfg(resume=str(done), num_server_rounds=2, **same), None, "b")
        assert (done / "results.json").read_text() == body  # left as it was


def test_an_extended_run_keeps_spending_the_same_budget(make_cfg, pretrained_clip):
    nodes = _partitions(2)
    same = {"method": "promptfl", "privacy__noise_multiplier": 1.0}
    first = make_cfg(run_name="short", num_server_rounds=2, **same)
    short = execute(first, _grid(first, nodes), run_id="a")
    spent = short.data["privacy"]["rounds"][-1]["epsilon"]
    longer = make_cfg(resume=str(short.dir), num_server_rounds=3, **same)
    extended = execute(longer, _grid(longer, nodes), run_id="b")
    rounds = extended.data["privacy"]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3] and rounds[1]["epsilon"] == spent < rounds[2]["epsilon"]


def test_a_run_whose_nodes_changed_resumes_on_its_own_plan(make_cfg, pretrained_clip):
    """DP-FPL's plan depends on the nodes (the global average's denominator, each node's local
    noise): it used to be re-made from whoever was connected at resume, and refused as 'another
    config'. Now the interrupted run's plan is kept: a node gone is not sampled, a new one is
    admitted late, and the nodes planned before spend exactly what they spent."""
    overrides = {"method": "dpfpl", "privacy__epsilon": 1.0, "num_server_rounds": 3, "min_nodes": 2}
    cfg = make_cfg(run_name="moved", **overrides)
    before = [{"partition-id": i, "num-partitions": 4} for i in range(3)]
    with pytest.raises(Killed):
        execute(cfg, _grid(cfg, before, _kill_in_round(2)), run_id="first")
    run_dir = cfg.output_dir + "/moved"
    first = json.loads(Path(run_dir, "results.json").read_text())
    planned = {c: m["sigma"] for c, per in first["privacy"]["client_mechanisms"].items() for m in per.values()}
    after = [{"partition-id": i, "num-partitions": 4} for i in (0, 1, 3)]  # client-2 gone, client-3 new
    resumed_cfg = make_cfg(resume=run_dir, **overrides)
    data = execute(resumed_cfg, _grid(resumed_cfg, after), run_id="second").data
    assert data["run"]["status"] == "finished" and [r["round"] for r in data["rounds"]] == [1, 2, 3]
    assert data["privacy"]["mechanisms"]["gdp-global"]["sigma"] == first["privacy"]["mechanisms"]["gdp-global"]["sigma"]
    for client, sigma in planned.items():  # the planned nodes draw the noise they were planned with
        assert next(iter(data["privacy"]["client_mechanisms"][client].values()))["sigma"] == sigma
    assert "client-3" in data["privacy"]["client_mechanisms"]  # admitted late
    assert "client-2" not in data["rounds"][-1]["clients"]
    assert max(data["privacy"]["spent"].values()) <= 1.0 * (1 + 1e-6)


def test_resuming_a_run_that_is_still_running_is_refused(make_cfg, pretrained_clip):
    from fedvlm.utils.files import try_hold

    cfg = make_cfg(method="promptfl", num_server_rounds=3, run_name="live")
    with pytest.raises(Killed):
        execute(cfg, _grid(cfg, _partitions(2), _kill_in_round(2)), run_id="first")
    run_dir = cfg.output_dir + "/live"
    live = try_hold(Path(run_dir) / "run.lock")  # its ServerApp, still at work
    try:
        resumed = make_cfg(method="promptfl", num_server_rounds=3, resume=run_dir)
        with pytest.raises(ResumeError, match="still running"):
            execute(resumed, _grid(resumed, _partitions(2)), run_id="second")
    finally:
        live.close()
    resumed = make_cfg(method="promptfl", num_server_rounds=3, resume=run_dir)
    assert execute(resumed, _grid(resumed, _partitions(2)), run_id="third").data["run"]["status"] == "finished"


def test_a_nodes_ledger_counts_a_resumed_round_again_with_os_noise(make_cfg, pretrained_clip, tmp_path):
    """A node with its own limit (OS noise, its ledger in its state-dir) trains round 2, the server
    dies before the round completes, and the resumed run asks for round 2 again: the node's
    ledger, across both runs' processes, holds round 2 twice (two independent releases)."""
    state = tmp_path / "node-0"
    limited = {"partition-id": 0, "num-partitions": 3, "max-epsilon": 10.0, "delta": 1e-5, "state-dir": str(state)}
    nodes = [limited, *({"partition-id": i, "num-partitions": 3} for i in (1, 2))]
    same = {"method": "promptfl", "num_server_rounds": 3, "max_per_class": 6, "privacy__epsilon": 2.0}
    cfg = make_cfg(run_name="limited", **same)
    with pytest.raises(Killed):  # the first train reply of round 2 is node 0's: it has trained and counted it
        execute(cfg, _grid(cfg, nodes, _kill_in_round(2)), run_id="first")
    later = make_cfg(resume=str(Path(cfg.output_dir) / "limited"), **same)
    resumed = execute(later, _grid(later, nodes), run_id="second")
    assert resumed.data["run"]["status"] == "finished"
    (ledger,) = (state / "ledgers").glob("*.json")
    rows = json.loads(ledger.read_text())["rows"]
    assert [r["round"] for r in rows] == [1, 2, 2, 3] and {r["noise-source"] for r in rows} == {"os"}
    assert len({r["run"] for r in rows}) == 1  # one run, resumed: its folder names it
    assert [r["epsilon"] for r in rows] == sorted(r["epsilon"] for r in rows)
