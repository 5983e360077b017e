"""pFedMoAP's attention gate and mixture logits (models.gating) against a hand-written loop,
its per-sample gradients (privacy.dpsgd, ``direct`` leaves) against one backward per record,
and the server's expert selection (strategies.pfedmoap.nearest)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedvlm.models.gating import AttentionGate, GateShapeError, moe_logits
from fedvlm.privacy.dpsgd import functional_per_sample
from fedvlm.strategies.pfedmoap import nearest

D, DG, H, C, K = 64, 16, 4, 5, 3


def _inputs(b: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(b, D, generator=g), dim=-1)
    local = F.normalize(torch.randn(C, D, generator=g), dim=-1)
    experts = F.normalize(torch.randn(K, C, D, generator=g), dim=-1)
    torch.manual_seed(seed)
    return image, local, experts, AttentionGate(D, DG, H, scale=10.0)


def _loop_logits(gate, image, local, experts, s, lam):
    """One image, one class, one head at a time, written from METHODS.md's formula."""
    stride, dh = D // DG, DG // H
    lin = lambda layer, x: layer.weight @ x + layer.bias  # noqa: E731
    out = torch.zeros(image.shape[0], C)
    for b in range(image.shape[0]):
        pooled = image[b, ::stride]
        q = lin(gate.q, pooled)
        for c in range(C):
            texts = [local[c]] + [experts[j, c] for j in range(K)]
            keys = [lin(gate.k, t[::stride]) for t in texts]
            vals = [lin(gate.v, t[::stride]) for t in texts]
            mixed = []
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                scores = torch.stack([10.0 * (q[sl] @ k[sl]) for k in keys])
                w = torch.softmax(scores, dim=0)
                mixed.append(sum(w[e] * vals[e][sl] for e in range(len(texts))))
            t_moe = lin(gate.o, torch.cat(mixed))  # not normalised
            cos = image[b] @ local[c] / (image[b].norm() * local[c].norm())
            out[b, c] = s * (pooled @ t_moe) + lam * s * cos
    return out


def test_logits_equal_the_hand_written_formula():
    image, local, experts, gate = _inputs()
    got = moe_logits(gate, image, local, experts, 7.0, 0.5)
    torch.testing.assert_close(got, _loop_logits(gate, image, local, experts, 7.0, 0.5), rtol=1e-5, atol=1e-5)


def test_the_gate_has_the_specified_weights_and_refuses_shapes_it_cannot_pool():
    assert sum(p.numel() for p in AttentionGate(512, 128, 8).parameters()) == 66_048
    with pytest.raises(GateShapeError, match="must divide the CLIP embedding dimension 512"):
        AttentionGate(512, 96, 8)
    with pytest.raises(GateShapeError, match="not divisible by pfedmoap.gating-heads = 3"):
        AttentionGate(512, 128, 3)


def test_logits_do_not_depend_on_the_order_of_the_experts():
    image, local, experts, gate = _inputs()
    perm = torch.tensor([2, 0, 1])
    torch.testing.assert_close(
        moe_logits(gate, image, local, experts, 7.0, 0.5), moe_logits(gate, image, local, experts[perm], 7.0, 0.5)
    )


def test_with_lambda_zero_the_prompt_still_gets_a_gradient():
    image, local, experts, gate = _inputs()
    local = local.clone().requires_grad_(True)
    moe_logits(gate, image, local, experts, 7.0, 0.0).logsumexp(1).sum().backward()
    assert local.grad is not None and float(local.grad.norm()) > 0  # through the gate's keys and values


def test_per_sample_gradients_of_prompt_and_gate_equal_one_backward_per_record():
    """The prompt reaches the losses through its text features, the gate acts on each record:
    both per-sample gradients from the batched passes equal a per-record loop."""
    image, _, experts, gate = _inputs(b=5, seed=1)
    g = torch.Generator().manual_seed(2)
    ctx = torch.randn(4, 8, generator=g).requires_grad_(True)
    tower = torch.randn(C * D, 4 * 8, generator=g) / 8  # a stand-in text tower: ctx -> [C, D]
    labels = torch.tensor([0, 1, 2, 3, 4])

    def losses(idx):
        text = F.normalize((tower @ ctx.reshape(-1)).view(C, D), dim=-1)
        logits = moe_logits(gate, image[idx], text, experts, 7.0, 0.5)
        return F.cross_entropy(logits, labels[idx], reduction="none"), text

    leaves = {"ctx": ctx, **{f"gate.{k}": p for k, p in gate.named_parameters()}}
    direct = [k for k in leaves if k.startswith("gate.")]
    batch_losses, text = losses(torch.arange(5))
    got = functional_per_sample(batch_losses, leaves, [text], chunk=2, direct=direct)
    for i in range(5):
        loss_i, _ = losses(torch.tensor([i]))
        want = torch.autograd.grad(loss_i.sum(), list(leaves.values()))
        for k, w in zip(leaves, want, strict=True):
            torch.testing.assert_close(got[k][i], w, rtol=1e-5, atol=1e-6, msg=f"{k}, record {i}")


def test_nearest_is_brute_force_without_the_node_and_breaks_ties_by_name():
    rng = np.random.default_rng(0)
    pool = {f"n{i:02d}": rng.normal(size=(4, 6)).astype(np.float32) for i in range(12)}
    own = pool["n03"]
    others = {k: v for k, v in pool.items() if k != "n03"}
    brute = sorted(others, key=lambda k: math.dist(own.ravel().astype(float), others[k].ravel().astype(float)))
    assert nearest(own, others, 4) == brute[:4] and "n03" not in nearest(own, others, 11)
    zero = np.zeros((4, 6), dtype=np.float32)
    tied = {"b": zero + 1, "a": zero - 1, "c": zero + 2}  # 'a' and 'b' exactly equally far
    assert nearest(zero, tied, 2) == ["a", "b"] and nearest(zero, tied, 1) == ["a"]
