"""Membership-inference attacks: metrics, attack models on controlled records, and a run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedvlm.attacks.membership import Records, ShadowAttack, attack_metrics, client_records
from fedvlm.attacks.run import run_attacks
from fedvlm.client_app.app import app as client_app
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid


def test_metrics_on_known_scores():
    member = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    perfect = attack_metrics(np.r_[np.full(50, 0.9), np.full(50, 0.1)], member, 0.5)
    assert perfect["accuracy"] == 1.0 and perfect["auc"] == 1.0 and perfect["tpr@1%fpr"] == 1.0
    rng = np.random.default_rng(0)
    chance = attack_metrics(rng.random(100_0)[:100], member, 0.5)
    assert 0.3 < chance["auc"] < 0.7
    # 50 non-members allow no false positive at FPR <= 1%: its chance is 1/51, printed beside it
    assert perfect["tpr@1%fpr-chance"] == chance["tpr@1%fpr-chance"] == pytest.approx(1 / 51)


def _records(n, overfit, rng, client="c"):
    """Softmax vectors over 10 classes; members get `overfit` extra logit on their label."""
    labels = rng.integers(0, 10, 2 * n)
    member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    logits = rng.normal(0, 1, (2 * n, 10))
    logits[np.arange(2 * n), labels] += 1.0 + overfit * member
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return Records(probs, labels, member, client)


@pytest.mark.parametrize("per_class", [False, True])
def test_attack_separates_an_overfit_model_and_not_a_fair_one(per_class):
    rng = np.random.default_rng(1)
    shadow = [_records(300, 2.0, rng, f"s{i}") for i in range(4)]
    attack = ShadowAttack(shadow, per_class=per_class, n_classes=10)
    overfit = attack.evaluate([_records(300, 2.0, rng, "t")])["summary"]
    assert overfit["shokri"]["auc"] > 0.75 and overfit["loss-threshold"]["accuracy"] > 0.65
    fair_attack = ShadowAttack([_records(300, 0.0, rng, f"s{i}") for i in range(4)], per_class=per_class, n_classes=10)
    fair = fair_attack.evaluate([_records(300, 0.0, rng, "t")])["summary"]
    assert abs(fair["shokri"]["auc"] - 0.5) < 0.08 and abs(fair["loss-threshold"]["auc"] - 0.5) < 0.08


def test_members_and_non_members_are_explicit_and_disjoint(make_cfg, pretrained_clip):
    cfg = make_cfg(method="coop", num_server_rounds=1, max_per_class=4)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)], cfg.as_dict())
    rec = execute(cfg, grid, run_id="t")
    from fedvlm.attacks.membership import load_published

    pub = load_published(rec.dir / "published")
    assert set(pub) == {"client-0", "client-1"}
    r = client_records(cfg, pub["client-0"], 2, seed=0)
    assert r.member.sum() == (~r.member).sum() == 80  # 20 classes x 4 shots, balanced
    np.testing.assert_allclose(r.probs.sum(1), 1.0, rtol=1e-5)


# PromptFL whose upload is linear in the batch's gradients (one plain SGD step), with the server's
# record of uploads: every attack of the command runs on it, the server's among them
LINEAR_UPLOADS = {
    "prompt__optimizer": "sgd",
    "prompt__momentum": 0.0,
    "prompt__weight_decay": 0.0,
    "prompt__batch_size": 8,
    "prompt__local_steps": 1,
    "attack__observe_uploads": True,
}


def test_attack_run_writes_mia_json(make_cfg, pretrained_clip):
    cfg = make_cfg(method="promptfl", num_server_rounds=3, max_per_class=1, **LINEAR_UPLOADS)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)], cfg.as_dict())
    rec = execute(cfg, grid, run_id="t")
    with pytest.raises(ValueError, match="even"):
        run_attacks(rec.dir, shadows=1, online=1)
    res = run_attacks(rec.dir, shadows=1, online=2)
    saved = json.loads((rec.dir / "mia.json").read_text())
    assert saved["summary"] == res["summary"]
    for name in ("shokri", "loss-threshold"):
        for k in ("accuracy", "auc", "tpr@1%fpr"):
            assert 0.0 <= res["summary"][name][k] <= 1.0
    assert res["shadows"]["clients"] == 3 and len(res["per_client"]) == 3
    # LiRA and RMIA with the shadow clients as references, intervals from the fixed-seed bootstrap
    assert saved["online_references"] == 2
    for name in ("lira-offline", "rmia-offline", "lira-online"):
        pooled = saved["summary"][name]["pooled"]
        for k in ("auc", "tpr@0.1%fpr", "tpr@1%fpr"):
            low, high = pooled[k]["ci95"]
            assert 0.0 <= low <= pooled[k]["value"] <= high <= 1.0
        assert all(name in figures for figures in saved["per_client"].values())
    # the server's attacks on every upload: calibrated by the shadow and the online references'
    # uploads; the decomposition finds the rounds' batches (3 rounds x 8 of ~14 members per client)
    assert saved["server_attack"].startswith("every upload")
    for name in ("server-alignment", "server-decomposition", "server-lira-offline", "server-lira-online"):
        assert name in saved["summary"] and all(name in f for f in saved["per_client"].values())
    assert saved["summary"]["server-decomposition"]["pooled"]["auc"]["ci95"][0] > 0.55


def test_attacks_score_pfedmoaps_personalised_model_with_its_gate(make_cfg, pretrained_clip):
    """pFedMoAP publishes {its prompt, its experts, its gate}; the attacks score exactly that."""
    cfg = make_cfg(method="pfedmoap", num_server_rounds=2, max_per_class=4, pfedmoap__k=1)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)], cfg.as_dict())
    rec = execute(cfg, grid, run_id="t")
    from fedvlm.attacks.membership import load_published

    pub = load_published(rec.dir / "published")["client-0"]
    assert pub["prompts"]["experts"].shape[0] == 1 and any(k.startswith("gate.") for k in pub["prompts"])
    # the published model without its gate is a different model: the attack must not drop it
    r = client_records(cfg, pub, 3, seed=0)
    plain = dict(pub, prompts={"ctx": pub["prompts"]["ctx"]})
    assert not np.allclose(r.probs, client_records(cfg, plain, 3, seed=0).probs)
    with pytest.raises(ValueError, match="even"):
        run_attacks(rec.dir, shadows=1, online=1)
    res = run_attacks(rec.dir, shadows=1, online=2)
    assert res["method"] == "pfedmoap" and len(res["per_client"]) == 3


def test_a_reference_federation_node_trains_on_its_half_of_the_candidates(make_cfg):
    from fedvlm.client_app.node import node_data
    from fedvlm.data.membership import membership_candidates, reference_inclusion

    node_cfg = {"partition-id": 1, "num-partitions": 2}
    target = node_data(make_cfg(method="coop", max_per_class=4), node_cfg)
    ref = node_data(make_cfg(method="coop", max_per_class=4, attack__reference=2, attack__candidate_seed=5), node_cfg)
    members, non_members = membership_candidates(target.part, 5, 1)
    inside = reference_inclusion(target.part, 5, 1, 2)
    offset = len(target.splits.train)
    expected = np.r_[members, offset + non_members][inside]
    assert set(expected) <= set(ref.part.train) and len(ref.part.train) == len(target.part.train)
    assert not set(np.r_[members, offset + non_members][~inside]) & set(ref.part.train)
    labels = ref.splits.train.labels[ref.part.train]
    assert set(labels) == set(target.part.classes)  # non-members are of the client's own classes
