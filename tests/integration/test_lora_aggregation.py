"""FedRand's per-half aggregation and the adapter name selections, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from fedvlm.models import adapter_parts
from fedvlm.strategies.aggregation import per_group_average

GROUPS = {"A": ["l0.lora_A.weight"], "B": ["l0.lora_B.weight"]}


def _update(a: float, b: float) -> dict[str, np.ndarray]:
    return {"l0.lora_A.weight": np.full((2, 3), a, np.float32), "l0.lora_B.weight": np.full((3, 2), b, np.float32)}


def test_each_half_is_averaged_over_the_clients_that_had_it_weighted_by_data():
    current = _update(100.0, 200.0)
    updates = [_update(1.0, 10.0), _update(3.0, 30.0), _update(5.0, 50.0)]
    sizes = [10, 30, 60]
    out = per_group_average(current, GROUPS, updates, sizes, chosen=["A", "B", "A"])
    # A: clients 0 and 2 only, normalised by their own sizes (10 + 60)
    assert np.allclose(out["l0.lora_A.weight"], (10 * 1.0 + 60 * 5.0) / 70)
    # B: client 1 alone
    assert np.allclose(out["l0.lora_B.weight"], 30.0)


def test_a_half_nobody_selected_stays_unchanged():
    current = _update(100.0, 200.0)
    out = per_group_average(current, GROUPS, [_update(1.0, 10.0), _update(2.0, 20.0)], [1, 3], chosen=["A", "A"])
    assert np.allclose(out["l0.lora_A.weight"], (1 * 1.0 + 3 * 2.0) / 4)
    assert np.array_equal(out["l0.lora_B.weight"], current["l0.lora_B.weight"])


def test_without_normalisation_the_result_would_differ():
    # the ablation the paper reports: dividing by all clients' data instead of the half's
    updates, sizes = [_update(2.0, 0.0), _update(0.0, 4.0)], [1, 1]
    out = per_group_average(_update(0, 0), GROUPS, updates, sizes, chosen=["A", "B"])
    assert np.allclose(out["l0.lora_A.weight"], 2.0)  # not 1.0
    assert np.allclose(out["l0.lora_B.weight"], 4.0)


NAMES = [
    f"model.language_model.layers.{i}.self_attn.{m}.lora_{h}.weight"
    for i in range(4)
    for m in ("q_proj", "v_proj")
    for h in "AB"
]


def test_halves_split_every_layer():
    a, b = adapter_parts.lora_half(NAMES, "A"), adapter_parts.lora_half(NAMES, "B")
    assert len(a) == len(b) == 8 and not set(a) & set(b) and set(a) | set(b) == set(NAMES)
    with pytest.raises(ValueError):
        adapter_parts.lora_half(NAMES, "C")


def test_fedper_shares_the_top_layers():
    top = adapter_parts.top_layers(NAMES, 2)
    assert {n.split(".layers.")[1].split(".")[0] for n in top} == {"2", "3"}
    with pytest.raises(ValueError, match="4 adapted layers"):
        adapter_parts.top_layers(NAMES, 5)


def test_fedpara_shares_the_first_loha_pair():
    names = [f"m.layers.0.q_proj.hada_{w}" for w in ("w1_a", "w1_b", "w2_a", "w2_b")]
    assert adapter_parts.loha_global(names) == ["m.layers.0.q_proj.hada_w1_a", "m.layers.0.q_proj.hada_w1_b"]


def test_vlm_family_defaults_and_dataset_mismatch():
    from fedvlm.methods.validation import validate
    from fedvlm.runconfig import ConfigError

    cfg = validate({"method": "fedrand"})
    assert (cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.fraction_train) == (
        "embedded-captions",
        "dirichlet",
        0.5,
        0.3,
    )
    assert cfg.lora.lr == 3e-3  # the embedded tiny VLM; hub models get the paper's 3e-4
    assert validate({"method": "fedrand", "vlm.model": "org/some-vlm"}).lora.lr == 3e-4
    assert validate({}).dirichlet_alpha == 0.3 and validate({}).fraction_train == 1.0
    with pytest.raises(ConfigError, match="does not fit method 'fedrand'"):
        validate({"method": "fedrand", "dataset": "embedded"})
    with pytest.raises(ConfigError, match="does not fit method 'promptfl'"):
        validate({"method": "promptfl", "dataset": "embedded-vqa"})
    with pytest.raises(ConfigError, match="needs 'data-root'"):
        validate({"method": "fedrand", "dataset": "coco-captions"})


def test_missing_coco_files_name_the_path(tmp_path):
    from fedvlm.data.vlm_data import VLMDataError, load_vlm_dataset

    with pytest.raises(VLMDataError, match="captions_train2017.json does not exist"):
        load_vlm_dataset("coco-captions", str(tmp_path))


def test_coco_style_loader_reads_captions_and_largest_object(tmp_path):
    import json

    from PIL import Image

    from fedvlm.data.vlm_data import NO_OBJECT, load_coco_style

    (tmp_path / "imgs").mkdir()
    for i in (1, 2):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(tmp_path / "imgs" / f"{i}.jpg")
    caps = {
        "images": [{"id": 1, "file_name": "1.jpg"}, {"id": 2, "file_name": "2.jpg"}],
        "annotations": [
            {"image_id": 1, "caption": "a cat. "},
            {"image_id": 1, "caption": "cat"},
            {"image_id": 2, "caption": "a dog"},
        ],
    }
    inst = {
        "categories": [{"id": 7, "name": "cat"}, {"id": 9, "name": "dog"}],
        "annotations": [
            {"image_id": 1, "category_id": 9, "area": 5},
            {"image_id": 1, "category_id": 7, "area": 50},
            {"image_id": 2, "category_id": 9, "area": 3},
        ],
    }
    (tmp_path / "captions_val.json").write_text(json.dumps(caps))
    (tmp_path / "instances_val.json").write_text(json.dumps(inst))
    split, names = load_coco_style(tmp_path / "captions_val.json", tmp_path / "imgs", "t")
    assert names == ["cat", "dog", NO_OBJECT] and list(split.labels) == [0, 1]
    assert split.references[0] == ["a cat.", "cat"] and split.targets[1] == "a dog"
    assert split.images.image(1).size == (8, 8)


def test_scienceqa_loader_reads_a_saved_hf_dataset(tmp_path):
    import datasets
    from PIL import Image

    from fedvlm.data.vlm_data import load_vlm_dataset

    def rows(n, offset):
        return {
            "image": [Image.new("RGB", (6, 6), (i * 20, 0, 0)) if i % 3 else None for i in range(offset, offset + n)],
            "question": [f"q{i}?" for i in range(n)],
            "choices": [["yes", "no", "maybe"]] * n,
            "answer": [i % 3 for i in range(n)],
            "hint": ["" if i % 2 else "ctx" for i in range(n)],
            "topic": ["physics" if i % 2 else "biology" for i in range(n)],
        }

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "question": datasets.Value("string"),
            "choices": datasets.Sequence(datasets.Value("string")),
            "answer": datasets.Value("int64"),
            "hint": datasets.Value("string"),
            "topic": datasets.Value("string"),
        }
    )
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows(9, 0), features=features),
            "test": datasets.Dataset.from_dict(rows(6, 0), features=features),
        }
    )
    dd.save_to_disk(str(tmp_path / "sqa"))
    ds = load_vlm_dataset("scienceqa", str(tmp_path / "sqa"))
    assert ds.task == "vqa" and ds.label_names == ["biology", "physics"]
    assert len(ds.train) == 6 and len(ds.test) == 4  # questions without an image are dropped
    assert ds.train.targets[0] in "ABC" and "A. yes" in ds.train.prompts[0]
    assert ds.train.images.image(0).size == (6, 6)
