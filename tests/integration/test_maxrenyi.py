"""MaxRényi-K%: the entropies against closed forms, and the attack on a model overfit to its
members (clearly above chance) and on an untrained one (near chance)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedvlm.attacks.maxrenyi import ALPHAS, max_k_percent, renyi_entropy


def test_renyi_entropy_closed_forms():
    p = torch.tensor([0.5, 0.25, 0.25])
    logits = p.log()
    assert float(renyi_entropy(logits, 1.0)) == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)
    assert float(renyi_entropy(logits, 2.0)) == pytest.approx(-math.log(float((p**2).sum())), rel=1e-5)
    assert float(renyi_entropy(logits, 0.5)) == pytest.approx(2 * math.log(float(p.sqrt().sum())), rel=1e-5)
    assert float(renyi_entropy(logits, math.inf)) == pytest.approx(-math.log(0.5), rel=1e-5)
    uniform = torch.zeros(8)
    for a in ALPHAS:  # every order gives log n on the uniform distribution
        assert float(renyi_entropy(uniform, a)) == pytest.approx(math.log(8), rel=1e-5)


def test_max_k_percent():
    v = torch.tensor([1.0, 5.0, 3.0, 2.0, 4.0, 0.0, 0.5, 0.1, 0.2, 0.3])
    assert max_k_percent(v, 0) == 5.0
    assert max_k_percent(v, 10) == 5.0  # one of ten
    assert max_k_percent(v, 30) == pytest.approx(4.0)


def _memorisation_task(vlm_cache):
    """Scenes whose targets are random word strings keyed by a random code in the prompt:
    nothing but memorisation of the training pairs predicts them."""
    from fedvlm.client_app.vlm_node import vlm_dataset
    from fedvlm.methods.validation import validate

    cfg = validate({"method": "fedavg-lora", "cache-dir": str(vlm_cache), "lora.dropout": 0.0})
    ds = vlm_dataset(cfg)
    rng = np.random.default_rng(0)
    words = ["red", "blue", "circle", "square", "left", "right", "and", "the", "green", "cross", "middle", "on"]
    idx = rng.choice(len(ds.train), 48, replace=False)
    split = ds.train.subset(idx, "memo")
    split.prompts = [f"{p} {' '.join(rng.choice(words, 4))}" for p in split.prompts]
    split.targets = [" ".join(rng.choice(words, 4)) for _ in idx]
    members = split.subset(np.arange(16), "members")
    nonmembers = split.subset(np.arange(16, 48), "nonmembers")
    return cfg, members, nonmembers


def test_maxrenyi_separates_members_of_an_overfit_model_and_not_of_an_untrained_one(vlm_cache):
    from fedvlm.attacks.likelihood import bootstrap
    from fedvlm.attacks.maxrenyi import LOGLIK, auroc_and_tpr, reference_attacks, sample_scores
    from fedvlm.models.vlm import VLM, load_model_and_processor

    cfg, members, nonmembers = _memorisation_task(vlm_cache)
    # a private copy of the model (the cached one is shared by other tests)
    model, processor = load_model_and_processor(cfg.vlm.model, cfg.cache_path)
    vlm = VLM(model, processor, "memorise", torch.device("cpu"))

    loglik: dict[str, np.ndarray] = {}

    def aurocs(model_name: str) -> dict[str, dict]:
        ms = sample_scores(vlm, members, np.arange(len(members)))
        ns = sample_scores(vlm, nonmembers, np.arange(len(nonmembers)))
        loglik[model_name] = np.r_[ms.pop(LOGLIK), ns.pop(LOGLIK)]
        return {k: auroc_and_tpr(ms[k], ns[k]) for k in ms}

    untrained = aurocs("untrained")
    assert all(abs(r["auroc"] - 0.5) < 0.2 for r in untrained.values()), untrained

    # deliberately overfit: the whole language model, until the members' loss is near zero
    params = [p for n, p in model.named_parameters() if "language_model" in n]
    opt = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    torch.manual_seed(0)
    for step in range(160):
        idx = [(step * 8 + j) % len(members) for j in range(8)]
        batch = vlm.training_batch(
            [members.images.image(i) for i in idx], [members.prompts[i] for i in idx], [members.targets[i] for i in idx]
        )
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert loss.item() < 0.2
    overfit = aurocs("overfit")
    for key, r in overfit.items():
        assert r["auroc"] > 0.7, (key, r)
    assert max(r["tpr@5%fpr"] for r in overfit.values()) > 0.2
    # the attacks calibrated by a reference that never saw the data (here the untrained model)
    member = np.r_[np.ones(len(members), bool), np.zeros(len(nonmembers), bool)]
    for name, scores in reference_attacks(loglik["overfit"], loglik["untrained"], member).items():
        auc = bootstrap(scores, member)["auc"]
        assert auc["ci95"][0] > 0.7, (name, auc)
