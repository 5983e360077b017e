"""A round's evaluation travels with the next round's train messages (``server_app.loop``,
``server_app.post``): one message per node and round; a node sampled for the
evaluation and not for the next round's training gets an evaluate message of its own in the
same exchange; the last round's evaluation goes alone. That the figures are those separate
messages gave is the regression fixture's check (``test_regression.py``, recorded before)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fedvlm.client_app.app import app as client_app
from fedvlm.protocol import EVALUATE_ARRAYS, EVALUATE_CONFIG, FINAL_ROUND, SERVER_ROUND
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid

NODES = 4


def test_each_round_is_one_exchange_carrying_the_previous_evaluation(make_cfg, pretrained_clip):
    seen = []  # (type, round, round of the evaluation it carries or None, node, final)

    def intercept(req, reply):
        if req.metadata.message_type in ("train", "evaluate"):
            config = req.content["config"]
            carried = int(req.content[EVALUATE_CONFIG][SERVER_ROUND]) if EVALUATE_CONFIG in req.content else None
            assert EVALUATE_ARRAYS not in req.content  # promptfl evaluates the arrays it trains from
            final = bool(config.get(FINAL_ROUND, False))
            seen.append(
                (req.metadata.message_type, int(config[SERVER_ROUND]), carried, req.metadata.dst_node_id, final)
            )
        return reply

    cfg = make_cfg(method="promptfl", num_server_rounds=3, fraction_train=0.5, run_name="travels")
    nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    run = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=intercept), run_id="travels")

    train = {r: [s for s in seen if s[0] == "train" and s[1] == r] for r in (1, 2, 3)}
    evaluate = {r: [s for s in seen if s[0] == "evaluate" and s[1] == r] for r in (1, 2, 3)}
    everyone = {s[3] for s in evaluate[3]}
    assert len(everyone) == NODES and all(s[4] for s in evaluate[3])  # the last goes alone, as the final one
    assert [len(train[r]) for r in (1, 2, 3)] == [2, 2, 2]
    assert all(s[2] is None for s in train[1])  # nothing evaluated before round 1
    for r in (1, 2):
        trainees = {s[3] for s in train[r + 1]}
        assert all(s[2] == r for s in train[r + 1])  # the next round's trainees evaluate round r first
        assert {s[3] for s in evaluate[r]} == everyone - trainees and not any(s[4] for s in evaluate[r])

    def exchange(s):  # round r's exchange: its train messages and round r - 1's evaluation
        kind, rnd, _, _, final = s
        return rnd if kind == "train" else "last" if final else rnd + 1

    per_node = Counter((exchange(s), s[3]) for s in seen)
    assert max(per_node.values()) == 1  # never two messages to one node in one exchange

    rounds = run.data["rounds"]
    assert [r["evaluated"] for r in rounds] == [True, True, True]
    assert all(r["metrics"]["eval-clients"] == NODES and r["metrics"]["train-clients"] == 2 for r in rounds)
    # each reply was judged by the phase whose message it answered: none was taken for a stray
    assert not any(r["dropped"] or r["missing"] for r in rounds), [r["dropped"] for r in rounds]
    for r in rounds[:2]:  # a carried evaluation adds no bytes to the message it travels in
        zero = [c for c, row in r["clients"].items() if row.get("evaluate/bytes_down") == 0]
        assert len(zero) == 2 and r["bytes"]["evaluate_down"] * 2 == rounds[2]["bytes"]["evaluate_down"]


@pytest.mark.slow  # 18 s: three runs; the other evaluation tests stay in CI
def test_evaluate_every_skips_the_rounds_between_and_trains_the_same(make_cfg, pretrained_clip):
    """``evaluate-every``: the rounds between evaluations send train messages only and are
    recorded complete without evaluation figures; the evaluated rounds' figures, and the prompts
    the last evaluation publishes, are those of a run evaluated every round (evaluation only
    evaluates: what the membership attacks' federations rely on, ``attacks.run._publish_only``)."""
    from fedvlm.attacks.membership import load_published

    def run(every: int, seen: list):
        def intercept(req, reply):
            if req.metadata.message_type in ("train", "evaluate"):
                carried = EVALUATE_CONFIG in req.content
                seen.append((req.metadata.message_type, int(req.content["config"][SERVER_ROUND]), carried))
            return reply

        name = f"every-{every}"
        cfg = make_cfg(method="fedotp", num_server_rounds=3, evaluate_every=every, run_name=name)
        nodes = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
        return execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict(), intercept=intercept), run_id=name)

    every_round, sparse, last_only = [], [], []
    full, two, one = run(1, every_round), run(2, sparse), run(3, last_only)
    assert [r["evaluated"] for r in two.data["rounds"]] == [None, True, True]
    assert [r["evaluated"] for r in one.data["rounds"]] == [None, None, True]
    assert not any(carried for _, _, carried in last_only)  # nothing evaluated travels with rounds 2 and 3
    assert [s for s in last_only if s[0] == "evaluate"] == [("evaluate", 3, False)] * NODES
    for record in one.data["rounds"][:2]:
        assert "local-acc" not in record["metrics"] and record["metrics"]["train-clients"] == NODES
    for rnd in (2, 3):  # an evaluated round's figures are the every-round run's
        want = full.data["rounds"][rnd - 1]["metrics"]
        got = (two if rnd == 2 else one).data["rounds"][rnd - 1]["metrics"]
        assert {k: got[k] for k in ("local-acc", "neighbor-acc", "train-loss")} == {
            k: want[k] for k in ("local-acc", "neighbor-acc", "train-loss")
        }
    assert one.data["final"]["local-acc-last10-mean"] == full.data["rounds"][2]["metrics"]["local-acc"]
    published = [load_published(r.dir / "published") for r in (full, one)]
    assert published[0].keys() == published[1].keys() and len(published[0]) == NODES
    for node, pub in published[0].items():
        theirs = published[1][node]["prompts"]
        assert pub["prompts"].keys() == theirs.keys()
        assert all(torch.equal(pub["prompts"][k], theirs[k]) for k in pub["prompts"])


def test_a_budget_stop_after_a_round_not_evaluated_evaluates_it_and_records_its_figures(make_cfg, pretrained_clip):
    """The budget stops the run after round 3 of 5 (DP-FPL, z = 1, max-epsilon 3.55); with
    evaluate-every 2 round 3 was not to be evaluated, yet it is the state the nodes publish: its
    evaluation runs and its record holds the figures, those of the run evaluated every round."""
    nodes = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    runs = {}
    for every in (1, 2):
        cfg = make_cfg(
            method="dpfpl",
            privacy__noise_multiplier=1.0,
            privacy__max_epsilon=3.55,
            num_server_rounds=5,
            evaluate_every=every,
            run_name=f"stop-{every}",
        )
        runs[every] = execute(cfg, InProcessGrid(client_app, nodes, cfg.as_dict()), run_id=f"stop-{every}")
    sparse, full = runs[2].data, runs[1].data
    assert sparse["run"]["status"] == full["run"]["status"] == "stopped"
    assert [r["evaluated"] for r in sparse["rounds"]] == [None, True, True]
    assert sparse["rounds"][2]["metrics"]["local-acc"] == full["rounds"][2]["metrics"]["local-acc"]
    assert sparse["final"]["local-acc"] == full["final"]["local-acc"]
    assert len(list((runs[2].dir / "published").glob("*.pt"))) == 3
