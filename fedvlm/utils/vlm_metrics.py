"""Scores of a VLM on a split: captioning (BLEU-1..4, ROUGE-L, CIDEr) or VQA exact match.

Caption metrics are the COCO caption evaluation's own implementations (``pycocoevalcap``'s
Bleu, Rouge and Cider scorers, pure Python). Its PTB tokenizer needs Java, so texts are
tokenized here the way it does for these metrics: lower case, punctuation removed, split on
white space. CIDEr's document frequencies come from the references of the split scored: a
client's CIDEr is computed on its own test set (the figures the run reports per client and,
weighted by test size, per federation).

VQA answers are scored by exact match of the first option letter the model writes
(``B``, ``B.``, ``(B)`` and ``B red`` all read as B), as LLaVA scores ScienceQA.
"""

from __future__ import annotations

import re

import numpy as np
import torch

_PUNCT = re.compile(r"[^\w\s]")
_LETTER = re.compile(r"^\W*([A-E])\b")


def caption_tokens(text: str) -> str:
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def caption_scores(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    if not predictions:
        return {}
    res = {i: [caption_tokens(p) or "<empty>"] for i, p in enumerate(predictions)}
    gts = {i: [caption_tokens(r) for r in refs] for i, refs in enumerate(references)}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    rouge, _ = Rouge().compute_score(gts, res)
    cider, _ = Cider().compute_score(gts, res)
    # reported x100 as in the papers (CIDEr's own scale already has 10 as a perfect score)
    out = {f"bleu-{n + 1}": 100.0 * float(b) for n, b in enumerate(bleu)}
    out["rouge-l"] = 100.0 * float(rouge)
    out["cider"] = 100.0 * float(cider)
    return out


def answer_letter(text: str) -> str:
    m = _LETTER.match(text.strip())
    return m.group(1) if m else ""


def vqa_accuracy(predictions: list[str], references: list[list[str]]) -> float:
    if not predictions:
        return 0.0
    hits = [answer_letter(p) == refs[0] for p, refs in zip(predictions, references, strict=True)]
    return 100.0 * float(np.mean(hits))


@torch.no_grad()
def test_loss(vlm, split, batch_size: int) -> float:
    total, n = 0.0, 0
    for s in range(0, len(split), batch_size):
        idx = range(s, min(len(split), s + batch_size))
        batch = vlm.training_batch(
            [split.images.image(i) for i in idx], [split.prompts[i] for i in idx], [split.targets[i] for i in idx]
        )
        losses = vlm.per_sample_loss(batch)
        total += float(losses.sum())
        n += len(losses)
    return total / max(n, 1)


def predictions(vlm, split, max_new_tokens: int, batch_size: int) -> list[str]:
    out: list[str] = []
    for s in range(0, len(split), batch_size):
        idx = range(s, min(len(split), s + batch_size))
        out += vlm.generate([split.images.image(i) for i in idx], [split.prompts[i] for i in idx], max_new_tokens)
    return out


def score_split(vlm, split, task: str, max_new_tokens: int, batch_size: int) -> dict[str, float]:
    """Loss and task metrics of ``vlm`` (with whatever adapter it holds now) on ``split``."""
    if not len(split):
        return {}
    preds = predictions(vlm, split, max_new_tokens, batch_size)
    scores = {"loss": test_loss(vlm, split, batch_size)}
    if task == "caption":
        scores.update(caption_scores(preds, split.references))
    else:
        scores["accuracy"] = vqa_accuracy(preds, split.references)
    return scores
