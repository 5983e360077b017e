"""Caption and VQA scoring: pycocoevalcap's scorers on known cases, answer-letter parsing."""

from __future__ import annotations

import pytest

from fedvlm.utils.vlm_metrics import answer_letter, caption_scores, caption_tokens, vqa_accuracy


def test_identical_captions_score_perfectly_and_wrong_ones_do_not():
    refs = [["a red circle on the left ."], ["a blue square in the middle ."], ["a green cross on the right ."]]
    perfect = caption_scores([r[0] for r in refs], refs)
    assert perfect["bleu-1"] == pytest.approx(100.0, abs=1e-3) and perfect["bleu-4"] == pytest.approx(100.0, abs=1e-3)
    assert perfect["rouge-l"] == pytest.approx(100.0)
    wrong = caption_scores(["pink", "yellow triangle", "the"], refs)
    assert wrong["bleu-4"] < 1 and wrong["cider"] < perfect["cider"] and wrong["rouge-l"] < 50


def test_partial_caption_is_in_between():
    refs = [["a red circle on the left and a blue square on the right ."]] * 2
    good = caption_scores(["a red circle on the left and a blue cross on the right ."] * 2, refs)
    assert 40 < good["bleu-4"] < 100 and 50 < good["rouge-l"] < 100


def test_tokenisation_drops_case_and_punctuation():
    assert caption_tokens("A Red, circle.") == "a red circle"


@pytest.mark.parametrize(
    "text,letter", [("B", "B"), ("B.", "B"), ("(C) red", "C"), (" A blue", "A"), ("blue", ""), ("", "")]
)
def test_answer_letter(text, letter):
    assert answer_letter(text) == letter


def test_vqa_accuracy():
    assert vqa_accuracy(["A", "B.", "red"], [["A"], ["C"], ["D"]]) == pytest.approx(100 / 3)
