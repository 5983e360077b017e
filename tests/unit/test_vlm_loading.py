"""What VLM users bring: a tokenizer without a pad token, COCO images no instance annotates."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedvlm.data.vlm_data import NO_OBJECT, load_coco_style
from fedvlm.models.vlm import VLMLoadError, ensure_pad_token


def _tokenizer(**special):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        ["a red circle on a blue square"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special)


def test_a_tokenizer_without_a_pad_token_pads_with_its_end_of_sequence_token():
    tok = _tokenizer(eos_token="</s>")
    with pytest.raises(ValueError):  # what the first batch hit before
        tok(["a red circle", "a blue square on a red circle"], padding=True)
    ensure_pad_token(tok, "my-vlm")
    batch = tok(["a red circle", "a blue square on a red circle"], padding=True)
    assert tok.pad_token == "</s>" and len(set(map(len, batch["input_ids"]))) == 1
    with pytest.raises(VLMLoadError, match="neither a pad nor an end-of-sequence token"):
        ensure_pad_token(_tokenizer(), "my-vlm")


def test_a_coco_image_no_instance_annotates_is_not_a_person(tmp_path):
    (tmp_path / "images").mkdir()
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in (1, 2, 3)]
    captions = [{"image_id": i, "caption": f"picture {i}"} for i in (1, 2, 3)]
    (tmp_path / "captions_train2017.json").write_text(json.dumps({"images": images, "annotations": captions}))
    categories = [{"id": 1, "name": "person"}, {"id": 17, "name": "cat"}]
    instances = [{"image_id": 1, "category_id": 17, "area": 5.0}, {"image_id": 3, "category_id": 1, "area": 2.0}]
    (tmp_path / "instances_train2017.json").write_text(json.dumps({"categories": categories, "annotations": instances}))
    split, names = load_coco_style(tmp_path / "captions_train2017.json", tmp_path / "images", "coco-test")
    assert names == ["person", "cat", NO_OBJECT]
    np.testing.assert_array_equal(split.images.labels, [1, 2, 0])  # image 2 has no instance: no object, not person
