"""FedOTP's transport and patch features, FedPGP's factors, and what their clients keep."""

from __future__ import annotations

import open_clip
import pytest
import torch

from fedvlm.client_app.app import app as client_app
from fedvlm.models import tiny_clip
from fedvlm.models.optimal_transport import unbalanced_sinkhorn
from fedvlm.models.patch_tokens import encode_patch_tokens
from fedvlm.server_app.app import execute
from fedvlm.utils.inprocess import InProcessGrid


def test_balanced_transport_meets_its_marginals_and_beats_the_uniform_plan():
    torch.manual_seed(0)
    cost = torch.rand(5, 16, 2)
    plan = unbalanced_sinkhorn(cost, eps=0.05, tau=float("inf"), iters=500, tol=0)
    torch.testing.assert_close(plan.sum(-1), torch.full((5, 16), 1 / 16), atol=1e-4, rtol=0)
    torch.testing.assert_close(plan.sum(-2), torch.full((5, 2), 1 / 2), atol=1e-4, rtol=0)
    uniform = torch.full_like(cost, 1 / 32)
    assert ((plan * cost).sum((-1, -2)) < (uniform * cost).sum((-1, -2))).all()


def test_unbalanced_transport_moves_less_mass_where_it_is_expensive():
    cheap = unbalanced_sinkhorn(torch.zeros(1, 8, 2), eps=0.1, tau=1.0)
    dear = unbalanced_sinkhorn(torch.full((1, 8, 2), 2.0), eps=0.1, tau=1.0)
    assert float(dear.sum()) < 1.0 < float(cheap.sum())  # KL-relaxed marginals: mass follows the cost


def test_patch_tokens_tiny_and_vit():
    tiny = tiny_clip.build_tiny_clip().eval()
    t = encode_patch_tokens(tiny, torch.randn(2, 3, 32, 32))
    assert t.shape == (2, 16, 128)
    torch.testing.assert_close(t.norm(dim=-1), torch.ones(2, 16))
    vit = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    v = encode_patch_tokens(vit, torch.randn(1, 3, 224, 224))
    assert v.shape == (1, 49, 512)
    # the patch map uses the pooled feature's projection: the class token through it is the pooled feature
    assert not vit.visual.output_tokens  # restored


def test_patch_tokens_of_a_resnet_clip_are_its_attention_pool_at_every_cell():
    """RN50 (the pFedMoAP comparison's backbone): the pool's output at the mean token is exactly
    the image feature, and every one of the 7x7 cells is computed the same way."""
    from fedvlm.models.patch_tokens import attention_pool_everywhere

    rn = open_clip.create_model("RN50", pretrained=None).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        everywhere = attention_pool_everywhere(rn.visual, x)
        torch.testing.assert_close(everywhere[:, 0], rn.visual(x), atol=1e-4, rtol=1e-4)
    tokens = encode_patch_tokens(rn, x)
    assert tokens.shape == (2, 49, 1024)
    torch.testing.assert_close(tokens.norm(dim=-1), torch.ones(2, 49))


@pytest.mark.parametrize("method,private_keys", [("fedotp", {"local_ctx"}), ("fedpgp", {"u", "v"})])
def test_baselines_keep_their_local_parts_private(make_cfg, pretrained_clip, method, private_keys):
    cfg = make_cfg(method=method, num_server_rounds=2, privacy__epsilon=1.0)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)], cfg.as_dict())
    rec = execute(cfg, grid, run_id="t")
    assert all(not r["dropped"] for r in rec.data["rounds"])
    up = {k for m in grid.replies if m.metadata.message_type == "train" for k in m.content["arrays"].keys()}
    assert up == {"global_grad"}
    for ctx in grid.contexts.values():
        state = ctx.state["private"].to_torch_state_dict()
        assert private_keys <= set(state)
    mechs = rec.data["privacy"]["client_mechanisms"]["client-0"]
    assert set(mechs) == {"ldp-local" if method == "fedotp" else "ldp-lowrank"}
    published = torch.load(rec.dir / "published" / "client-0.pt", weights_only=False)["prompts"]
    assert set(published) == ({"global", "local"} if method == "fedotp" else {"ctx"})


def test_a_global_prompt_stepped_on_the_node_averages_to_the_clients_prompts(make_cfg, pretrained_clip):
    """dpfpl.global-update = local (FedOTP's own FedAvg): each client steps the global prompt with
    its optimiser and returns start minus end; the server's sgd step at lr 1 lands on the mean of
    the clients' end prompts. Refused under privacy: the server's noise has no plan for it."""
    from fedvlm.methods.validation import validate
    from fedvlm.runconfig import ConfigError

    sets = {"dpfpl__global_update": "local", "dpfpl__server_lr": 1.0, "prompt__local_steps": 3}
    cfg = make_cfg(method="fedotp", num_server_rounds=1, **sets)
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)], cfg.as_dict())
    rec = execute(cfg, grid, run_id="t")
    sent = [m.content["arrays"]["global_ctx"].numpy() for m in grid.sent if m.metadata.message_type == "train"]
    start = torch.from_numpy(sent[0]).flatten()
    assert all((s == sent[0]).all() for s in sent)  # one global prompt, sent to both
    ends = [
        start - torch.from_numpy(m.content["arrays"]["global_grad"].numpy()).flatten()
        for m in grid.replies
        if m.metadata.message_type == "train"
    ]
    assert len(ends) == 2 and all(float((e - start).norm()) > 0 for e in ends)
    final = torch.as_tensor(
        torch.load(rec.dir / "final_shared.pt", weights_only=False)["arrays"]["global_ctx"]
    ).flatten()
    torch.testing.assert_close(final, torch.stack(ends).mean(0), atol=1e-6, rtol=1e-5)
    with pytest.raises(ConfigError, match="global-update='local'.*no privacy accounting"):
        validate({**cfg.as_dict(), "privacy.epsilon": 1.0})
