"""The honest-but-curious server: its record of every upload, and its attack on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedvlm.attacks.server import PromptModel, ServerAttack, record_gradients
from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.server_view import UploadView
from fedvlm.server_app.app import execute
from fedvlm.server_app.observer import FOLDER, load_rounds
from fedvlm.utils.inprocess import InProcessGrid


def _run(cfg, clients=2):
    nodes = [{"partition-id": i, "num-partitions": clients} for i in range(clients)]
    grid = InProcessGrid(client_app, nodes, cfg.as_dict())
    return execute(cfg, grid, run_id="t"), grid


def test_the_server_records_what_crossed_the_wire_only_when_asked(make_cfg, pretrained_clip):
    plain, _ = _run(make_cfg(method="dpfpl", num_server_rounds=2, max_per_class=2, run_name="plain"))
    assert not (plain.dir / FOLDER).exists()
    with pytest.raises(FileNotFoundError, match="attack.observe-uploads=true"):
        load_rounds(plain.dir)
    cfg = make_cfg(method="dpfpl", num_server_rounds=2, max_per_class=2, attack__observe_uploads=True)
    rec, grid = _run(cfg)
    rounds = load_rounds(rec.dir)
    assert [r.round for r in rounds] == [1, 2]
    replies = [m for m in grid.replies if "arrays" in m.content and len(m.content["arrays"])]
    for r in rounds:
        assert set(r.partition.values()) == {0, 1} and set(r.sent) == set(r.uploaded)
        for name in r.sent:
            assert set(r.sent[name]) == {"global_ctx"} and set(r.uploaded[name]) == {"global_grad"}
    # exactly the tensors the clients sent, in the order the rounds ran
    sent_up = [r.uploaded[n]["global_grad"].numpy() for r in rounds for n in sorted(r.uploaded)]
    wire = [m.content["arrays"]["global_grad"].numpy() for m in replies]
    assert len(wire) == len(sent_up) and all(any(np.array_equal(a, b) for b in wire) for a in sent_up)
    # keeping the record changes nothing of the run itself
    final = [torch.load(r.dir / "final_shared.pt", weights_only=True)["arrays"] for r in (plain, rec)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_the_decomposition_recovers_a_batch_from_its_averaged_gradient(make_cfg, pretrained_clip):
    """An upload that is the mean gradient of a batch of candidates: non-negative least squares on
    the candidates' gradients puts weight on the batch and on nothing else."""
    from scipy.optimize import nnls

    cfg = make_cfg(method="promptfl", max_per_class=4)
    model = PromptModel(cfg, 2, seed=0)
    cand = model.candidates(0)
    ctx = torch.randn(4, pretrained_clip.model.token_embedding.weight.shape[1]) * 0.02
    view = UploadView({"ctx": ctx}, {"ctx": torch.zeros_like(ctx)})
    grads = model.gradients(0, view).double()
    assert grads.shape == (len(cand.labels), ctx.numel())
    # each row is that record's own gradient: the batched pass agrees with one record at a time
    assert model.scorer is not None
    one = record_gradients(model.scorer, view, cand.feats[3:4], cand.labels[3:4]).double()
    torch.testing.assert_close(grads[3:4], one, rtol=1e-3, atol=1e-4 * float(grads.abs().max()))
    batch = np.random.default_rng(0).choice(np.flatnonzero(cand.member), 8, replace=False)
    descent = -grads[batch].mean(0)
    weights, residual = nnls(grads.T.numpy(), -descent.numpy())
    assert residual < 1e-6 * float(descent.norm())
    assert set(np.flatnonzero(weights > 1e-3 * weights.max())) == set(batch)


def test_a_method_that_uploads_nothing_has_nothing_to_attack(make_cfg, pretrained_clip):
    rec, _ = _run(make_cfg(method="coop", num_server_rounds=1, max_per_class=2, attack__observe_uploads=True))
    with pytest.raises(ValueError, match="shares nothing with the server"):
        ServerAttack(make_cfg(method="coop", max_per_class=2), 2, seed=0).scores(rec.dir)


def test_the_calibrated_attacks_read_the_references_of_each_record():
    """LiRA on the alignment: a record scored higher by the target than by every reference that
    never saw it is a member; online, the references that trained on it say what a member scores."""
    from fedvlm.attacks.likelihood import roc_metrics
    from fedvlm.attacks.server import server_scores

    rng = np.random.default_rng(0)
    member = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    hardness = rng.normal(0, 1, 100)  # how well a record aligns with any upload
    target = {"alignment": hardness + 0.5 * member, "decomposition": np.zeros(100)}
    offline = [{"alignment": hardness + rng.normal(0, 0.05, 100)} for _ in range(4)]
    halves = [rng.random(100) < 0.5 for _ in range(2)]
    inside = [h for a in halves for h in (a, ~a)]  # complementary pairs, as data/membership.py draws them
    online = [{"alignment": hardness + 0.5 * ins + rng.normal(0, 0.05, 100)} for ins in inside]
    scores = server_scores(target, offline, online, inside)
    assert set(scores) == {"server-alignment", "server-decomposition", "server-lira-offline", "server-lira-online"}
    assert roc_metrics(scores["server-alignment"], member)["auc"] < 0.75  # hardness hides the members
    for name in ("server-lira-offline", "server-lira-online"):
        assert roc_metrics(scores[name], member)["auc"] > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpfpl", "fedotp", "fedpgp", "pfedmoap"])
def test_the_server_reads_every_prompt_methods_uploads(make_cfg, pretrained_clip, method):
    """Each method's server_view and scorer give one finite score per candidate (FedOTP through its
    transport plan, pFedMoAP without the gate the server never sees)."""
    extra = {"pfedmoap__k": 1} if method == "pfedmoap" else {}
    cfg = make_cfg(method=method, num_server_rounds=2, max_per_class=1, attack__observe_uploads=True, **extra)
    rec, _ = _run(cfg)
    server = ServerAttack(cfg, 2, seed=0)
    scores = server.scores(rec.dir)
    assert set(scores) == {0, 1}
    for pid, s in scores.items():
        assert set(s) == {"alignment", "decomposition"}
        for v in s.values():
            assert v.shape == server.member(pid).shape and np.isfinite(v).all()
