"""The prompt-learning core against open_clip's own text encoder."""

from __future__ import annotations

import open_clip
import pytest
import torch
import torch.nn.functional as F

from fedvlm.data.embedded import CLASSNAMES
from fedvlm.models import tiny_clip
from fedvlm.models.prompt_learner import PromptEncoder, TextTower, clip_logits, init_context

NAMES = ["red circle", "blue square", "airplane", "golden retriever dog"]


def _phrase_ctx(tower, tok, phrase):
    ids = tok([phrase])
    n = int(tower.eot_positions(ids)[0]) - 1
    return tower.token_embedding(ids[0, 1 : 1 + n]).detach()


def _check_matches_encode_text(model, tok):
    tower = TextTower.from_open_clip(model)
    ctx = _phrase_ctx(tower, tok, "a photo of a")
    enc = PromptEncoder(tower, tok, NAMES, n_ctx=ctx.shape[0])
    ours = enc(ctx)
    with torch.no_grad():
        ref = F.normalize(model.encode_text(tok([f"a photo of a {n}." for n in NAMES])), dim=-1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    # The sequences were cut at the last EOT, well short of the full context.
    assert enc.token_ids.shape[1] < tower.context_length


def test_matches_encode_text_tiny_clip():
    model = tiny_clip.build_tiny_clip().eval()
    _check_matches_encode_text(model, tiny_clip.tokenizer())


def test_matches_encode_text_open_clip_vit():
    # A real open_clip architecture (random weights: no download here); 77-token context.
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    _check_matches_encode_text(model, open_clip.get_tokenizer("ViT-B-32"))


def test_class_specific_context_matches_per_class_text():
    model = tiny_clip.build_tiny_clip().eval()
    tok = tiny_clip.tokenizer()
    tower = TextTower.from_open_clip(model)
    phrases = ["a photo of a", "a drawing of a", "one big red thing", "the small blue thing"]
    ctx = torch.stack([_phrase_ctx(tower, tok, p) for p in phrases])  # each phrase is 4 tokens
    enc = PromptEncoder(tower, tok, NAMES, n_ctx=4)
    with torch.no_grad():
        ref = F.normalize(model.encode_text(tok([f"{p} {n}." for p, n in zip(phrases, NAMES, strict=True)])), dim=-1)
    torch.testing.assert_close(enc(ctx), ref, atol=1e-5, rtol=1e-4)


def test_many_contexts_in_one_pass_equal_one_at_a_time():
    model = tiny_clip.build_tiny_clip().eval()
    enc = PromptEncoder(TextTower.from_open_clip(model), tiny_clip.tokenizer(), NAMES, n_ctx=4)
    ctxs = torch.randn(3, 4, enc.tower.width, generator=torch.Generator().manual_seed(0)) * 0.02
    with torch.no_grad():
        many = enc.encode_many(ctxs)
        one_by_one = torch.stack([enc(c) for c in ctxs])
    assert many.shape == (3, len(NAMES), one_by_one.shape[-1])
    torch.testing.assert_close(many, one_by_one, atol=1e-6, rtol=1e-5)


def test_gradient_reaches_context_only():
    model = tiny_clip.build_tiny_clip().eval().requires_grad_(False)
    tok = tiny_clip.tokenizer()
    tower = TextTower.from_open_clip(model)
    enc = PromptEncoder(tower, tok, list(CLASSNAMES), n_ctx=16)
    ctx = init_context(tower, tok, 16, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    img = F.normalize(torch.randn(8, 128), dim=-1)
    loss = F.cross_entropy(clip_logits(img, enc(ctx), 10.0), torch.arange(8))
    loss.backward()
    assert ctx.grad is not None and ctx.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())


def test_init_context_random_and_phrase():
    model = tiny_clip.build_tiny_clip()
    tok = tiny_clip.tokenizer()
    tower = TextTower.from_open_clip(model)
    a = init_context(tower, tok, 16, generator=torch.Generator().manual_seed(3))
    b = init_context(tower, tok, 16, generator=torch.Generator().manual_seed(3))
    assert a.shape == (16, tower.width) and torch.equal(a, b)
    assert 0.015 < float(a.std()) < 0.025  # N(0, 0.02^2)
    cs = init_context(tower, tok, 8, n_classes=5, generator=torch.Generator().manual_seed(0))
    assert cs.shape == (5, 8, tower.width)
    ph = init_context(tower, tok, 16, phrase="a photo of a")
    assert ph.shape == (4, tower.width)  # the phrase's token count sets M, as in CoOp


def test_prompt_too_long_is_a_clear_error():
    model = tiny_clip.build_tiny_clip()
    tower = TextTower.from_open_clip(model)
    with pytest.raises(ValueError, match=r"prompt.n-ctx, or a shorter prompt.ctx-init phrase"):
        PromptEncoder(tower, tiny_clip.tokenizer(), ["a very long class name " * 3], n_ctx=16)


def test_a_zero_shot_template_that_cuts_the_class_name_off_is_refused(make_cfg, pretrained_clip):
    """open_clip's tokenizer truncates silently: a template too long for the text context made every
    class read the same text, and the run finished at chance with status 0."""
    from fedvlm.client_app.scoring import TemplateScorer
    from fedvlm.runconfig import ConfigError

    feats = torch.randn(3, pretrained_clip.model.visual.output_dim)
    fine = TemplateScorer(pretrained_clip, NAMES, make_cfg(method="zeroshot"))
    assert fine.logits({}, F.normalize(feats, dim=-1)).shape == (3, len(NAMES))
    long = "a photo of " + "a very " * 40 + "nice {}."
    scorer = TemplateScorer(pretrained_clip, NAMES, make_cfg(method="zeroshot", zeroshot__template=long))
    with pytest.raises(ConfigError, match=r"'zeroshot.template' makes .* tokens long.*class name would be cut off"):
        scorer.logits({}, feats)


def test_context_shape_errors():
    model = tiny_clip.build_tiny_clip()
    tok = tiny_clip.tokenizer()
    tower = TextTower.from_open_clip(model)
    enc = PromptEncoder(tower, tok, NAMES, n_ctx=4)
    with pytest.raises(ValueError, match="built for 4"):
        enc(torch.zeros(5, tower.width))
    with pytest.raises(ValueError, match="n_classes"):
        enc(torch.zeros(3, 4, tower.width))
