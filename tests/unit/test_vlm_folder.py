"""An organisation's own VLM data (data.vlm_data.load_vlm_folder): images plus data.jsonl records
for the run's task, loaded with the right labels, splits, prompts and targets; the export writes
exactly a simulated partition in that format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedvlm.data import scenes
from fedvlm.data.vlm_data import CAPTION_PROMPT_REAL, VLMDataError, load_vlm_folder, scienceqa_prompt
from tests.formats import decode, write_image


def _folder(root, records, labels=None):
    for r in records:
        write_image(root / r["image"], r.pop("_class", 0), r.get("split", "train"))
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    if labels:
        (root / "labels.txt").write_text("\n".join(labels) + "\n")
    return root


def test_captioning_records_load_with_their_labels_splits_and_the_runs_prompt(tmp_path):
    records = [
        {"image": "a.jpg", "caption": "a dog", "label": "dog", "split": "train", "_class": 1},
        {"image": "b.jpg", "captions": ["a cat", "one cat"], "label": "cat", "split": "test", "_class": 0},
        {"image": "c.jpg", "caption": "a cat again", "label": "cat", "split": "train", "_class": 0},
    ]
    ds = load_vlm_folder(_folder(tmp_path, records, ["cat", "dog"]), "coco-captions", 0.3, 0)
    assert (ds.task, ds.label_names) == ("caption", ["cat", "dog"])
    assert ds.train.targets == ["a dog", "a cat again"] and ds.test.references == [["a cat", "one cat"]]
    assert set(ds.train.prompts) == {CAPTION_PROMPT_REAL}  # the run's dataset decides the prompt
    # every image is where its record says, with its record's class and split
    for split, name in ((ds.train, "train"), (ds.test, "test")):
        assert [decode(split.images.image(i)) for i in range(len(split))] == [(int(y), name) for y in split.labels]
    embedded = load_vlm_folder(tmp_path, "embedded-captions", 0.3, 0)
    assert set(embedded.train.prompts) == {scenes.CAPTION_PROMPT}


def test_multiple_choice_records_take_an_answer_as_text_index_or_letter(tmp_path):
    q = {"question": "What colour?", "choices": ["red", "blue", "green"]}
    records = [{"image": f"{i}.jpg", **q, "answer": a} for i, a in enumerate(["blue", 2, "A"])]
    ds = load_vlm_folder(_folder(tmp_path, records), "scienceqa", 0.0, 0)
    assert ds.task == "vqa" and ds.label_names == ["unlabelled"]
    everything = ds.train.targets + ds.test.targets
    assert sorted(everything) == ["A", "B", "C"]
    assert ds.train.prompts[0] == scienceqa_prompt("What colour?", ["red", "blue", "green"])


@pytest.mark.parametrize(
    "records,dataset,match",
    [
        ([{"image": "a.jpg", "question": "q?", "choices": ["x"], "answer": "x"}], "embedded-captions", "captioning"),
        ([{"image": "a.jpg", "caption": "c"}], "embedded-vqa", "multiple-choice"),
        ([{"image": "missing.jpg", "caption": "c"}], "embedded-captions", "does not exist"),
        ([{"image": "a.jpg", "question": "q?", "choices": ["x"], "answer": "y"}], "scienceqa", "neither one of"),
        ([{"image": "a.jpg", "caption": "c", "split": "dev"}], "embedded-captions", "'split' is 'dev'"),
        ([{"image": "a.jpg", "caption": "c", "label": "zebra"}], "embedded-captions", "not in"),
    ],
)
def test_a_bad_folder_says_what_is_wrong_and_where(tmp_path, records, dataset, match):
    write_image(tmp_path / "a.jpg", 0, "train")
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "labels.txt").write_text("cat\n")
    with pytest.raises(VLMDataError, match=match):
        load_vlm_folder(tmp_path, dataset, 0.3, 0)


def test_a_folder_without_records_names_the_format(tmp_path):
    with pytest.raises(VLMDataError, match="data.jsonl.*export_folder"):
        load_vlm_folder(tmp_path, "embedded-captions", 0.3, 0)


def test_the_export_is_the_simulated_partition_in_the_own_data_format(tmp_path):
    from fedvlm.client_app.vlm_node import vlm_node_data
    from fedvlm.deploy.export_folder import export_partitions
    from fedvlm.methods.validation import validate

    folders = export_partitions(tmp_path, 2, {"method": "fedrand"})
    cfg = validate({"method": "fedrand"})
    for pid, folder in enumerate(folders):
        part = vlm_node_data(cfg, {"partition-id": pid, "num-partitions": 2})
        own = load_vlm_folder(folder, cfg.dataset, cfg.test_fraction, cfg.seed)
        for mine, theirs in ((own.train, part.train), (own.test, part.test)):
            assert mine.targets == theirs.targets and mine.references == theirs.references
            assert mine.prompts == theirs.prompts
            np.testing.assert_array_equal(mine.labels, theirs.labels)
            assert np.array_equal(np.asarray(mine.images.image(0)), np.asarray(theirs.images.image(0)))
