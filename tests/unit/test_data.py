"""The dataset registry: embedded, sklearn digits, torchvision layouts and image folders."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fedvlm.data import embedded
from fedvlm.data.registry import DatasetError, load_dataset


def test_embedded_is_deterministic_and_rich_enough():
    a = load_dataset("embedded")
    b = load_dataset("embedded")
    assert np.array_equal(a.train.images, b.train.images) and np.array_equal(a.test.labels, b.test.labels)
    assert a.n_classes >= 30 and a.classnames[0] == "red circle"
    assert len(set(a.classnames)) == a.n_classes
    assert np.bincount(a.train.labels).min() == np.bincount(a.train.labels).max()  # balanced
    img = a.train.image(0)
    assert img.mode == "RGB" and img.size == (32, 32)
    # train and test are different draws
    assert not np.array_equal(a.train.images[: len(a.test.images)], a.test.images)


def test_embedded_images_show_their_class():
    # the object's colour dominates the pixels inside its shape: a cheap sanity check that
    # images carry the label (red objects are redder than blue ones)
    imgs, labels, _ = embedded.generate(20, seed=5, style="pretrain")
    names = np.array(embedded.CLASSNAMES)[labels]
    red = imgs[[n.startswith("red") for n in names]].astype(float)
    blue = imgs[[n.startswith("blue") for n in names]].astype(float)
    assert red[..., 0].mean() - red[..., 2].mean() > blue[..., 0].mean() - blue[..., 2].mean() + 10


def test_digits_come_with_names():
    d = load_dataset("digits")
    assert d.n_classes == 10 and d.classnames[3] == "digit three"
    assert len(d.train) + len(d.test) == 1797
    assert d.train.image(0).mode == "RGB"


def test_max_per_class_makes_few_shot_sets():
    d = load_dataset("embedded", max_per_class=4, seed=1)
    assert np.bincount(d.train.labels).max() == 4
    assert d.train.identity != load_dataset("embedded").train.identity


def _write_folder(root, classes, n=3):
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def test_image_folder_split_and_names(tmp_path):
    _write_folder(tmp_path, ["golden_retriever", "tabby_cat"], n=10)
    d = load_dataset("image-folder", data_root=str(tmp_path), test_fraction=0.3)
    assert d.classnames == ["golden retriever", "tabby cat"]
    assert len(d.train) == 14 and len(d.test) == 6
    assert d.test.image(0).size == (20, 20)


def test_image_folder_with_train_test_subfolders(tmp_path):
    _write_folder(tmp_path / "train", ["a", "b"], n=4)
    _write_folder(tmp_path / "test", ["a", "b"], n=2)
    d = load_dataset("image-folder", data_root=str(tmp_path))
    assert (len(d.train), len(d.test)) == (8, 4)


def test_image_folder_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset("image-folder", data_root=str(tmp_path / "nope"))
    with pytest.raises(DatasetError, match="no class sub-folders"):
        load_dataset("image-folder", data_root=str(tmp_path))
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(DatasetError, match="empty_class.*hold no images"):
        load_dataset("image-folder", data_root=str(tmp_path))


def test_a_truncated_photo_is_reported_by_name_and_its_folder_keeps_no_secret_path(tmp_path):
    _write_folder(tmp_path / "site" / "train", ["a", "b"], n=4)
    _write_folder(tmp_path / "site" / "test", ["a", "b"], n=2)
    d = load_dataset("image-folder", data_root=str(tmp_path / "site"))
    # the identity goes to the server in the handshake: the folder's name, not where it lives
    assert str(tmp_path) not in d.train.identity and d.train.identity.startswith("folder:site:")
    victim = d.train.paths[5]
    victim.write_bytes(victim.read_bytes()[:40])
    with pytest.raises(DatasetError, match=rf"image {victim} of folder:site.*cannot be read.*replace or remove it"):
        d.train.image(5)


def test_classes_txt_fixes_the_federation_label_order(tmp_path):
    _write_folder(tmp_path, ["cat", "ant"], n=3)  # this organisation has two of the four classes
    (tmp_path / "classes.txt").write_text("dog\ncat\n# comment\nbee\nant\n")
    d = load_dataset("image-folder", data_root=str(tmp_path), test_fraction=0.3)
    assert d.classnames == ["dog", "cat", "bee", "ant"] and d.n_classes == 4
    assert sorted(set(d.train.labels.tolist()) | set(d.test.labels.tolist())) == [1, 3]
    (tmp_path / "classes.txt").write_text("dog\ncat\n")
    with pytest.raises(DatasetError, match="class folder\\(s\\) ant that classes.txt does not list"):
        load_dataset("image-folder", data_root=str(tmp_path))
    (tmp_path / "classes.txt").write_text("cat\nant\ncat\n")
    with pytest.raises(DatasetError, match="repeated: cat"):
        load_dataset("image-folder", data_root=str(tmp_path))


def test_exported_partitions_hold_exactly_the_simulated_partition(tmp_path):
    from fedvlm.client_app.node import node_data
    from fedvlm.deploy.export_folder import export_partitions
    from fedvlm.methods.validation import validate
    from fedvlm.runconfig import ConfigError

    folders = export_partitions(tmp_path, 3, {"max-per-class": 6})
    cfg = validate({"max-per-class": 6})
    for pid, folder in enumerate(folders):
        sim = node_data(cfg, {"partition-id": pid, "num-partitions": 3})
        own = load_dataset("image-folder", data_root=str(folder))
        assert own.classnames == sim.splits.classnames
        assert sorted(own.train.labels.tolist()) == sorted(sim.splits.train.labels[sim.part.train].tolist())
        assert sorted(own.test.labels.tolist()) == sorted(sim.splits.test.labels[sim.part.test].tolist())
        # pixels survive the PNG round trip
        first = sim.part.train[0]
        label = sim.splits.classnames[sim.splits.train.labels[first]]
        saved = Image.open(folder / "train" / label / "000000.png")
        assert np.array_equal(np.asarray(saved), np.asarray(sim.splits.train.image(int(first)).convert("RGB")))
    # a second export into the same folders (another seed) mixed two partitions' records in them
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=r"client-0 already holds files: export into an empty --out"):
        export_partitions(tmp_path, 3, {"max-per-class": 6, "seed": 1})
    with pytest.raises(ConfigError, match="--num-partitions 0: export at least one"):
        export_partitions(tmp_path / "new", 0)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("name", ["caltech101", "oxford-pets", "flowers102", "food101", "dtd", "cifar10", "cifar100"])
def test_missing_torchvision_data_says_where_and_how(tmp_path, name):
    with pytest.raises(DatasetError) as err:
        load_dataset(name, data_root=str(tmp_path), download=False)
    msg = str(err.value)
    assert name in msg and str(tmp_path) in msg and "download=true" in msg


def test_coop_split_file_is_used(tmp_path):
    import json

    img_dir = tmp_path / "oxford-iiit-pet" / "images"
    img_dir.mkdir(parents=True)
    rows = []
    for i, (cls, label) in enumerate([("abyssinian", 0), ("basset_hound", 1)] * 3):
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(img_dir / f"{cls}_{i}.jpg")
        rows.append([f"{cls}_{i}.jpg", label, cls])
    (tmp_path / "split_zhou_OxfordPets.json").write_text(json.dumps({"train": rows[:4], "val": [], "test": rows[4:]}))
    d = load_dataset("oxford-pets", data_root=str(tmp_path))
    assert d.classnames == ["abyssinian", "basset hound"]
    assert (len(d.train), len(d.test)) == (4, 2)
    assert d.train.image(1).size == (8, 8)


def test_varied_captions_show_the_same_scenes_each_phrased_its_own_way():
    from fedvlm.data import scenes
    from fedvlm.data.vlm_data import load_vlm_dataset

    plain, varied = scenes.generate("caption", 200, 7), scenes.generate("caption-varied", 200, 7)
    np.testing.assert_array_equal(plain.images, varied.images)  # the same scenes
    np.testing.assert_array_equal(plain.labels, varied.labels)
    vocabulary = set(scenes.vocabulary())
    for fixed, said, refs in zip(plain.targets, varied.targets, varied.references, strict=True):
        assert said in refs and fixed == refs[0]  # one of the scene's phrasings; the plain one first
        assert len(set(refs)) == len(refs) == (16 if " and " in fixed else 8)
        assert set(" ".join(refs).split()) <= vocabulary  # no word the tokenizer lacks
    assert len({t.split(" ")[0] for t in varied.targets}) >= 4  # openings drawn per record: a, one, there, on/in
    assert sum(a != b for a, b in zip(plain.targets, varied.targets, strict=True)) > 150
    ds = load_vlm_dataset("embedded-captions-varied", max_train=50)
    assert ds.task == "caption" and ds.name == "embedded-captions-varied" and ds.ood is not None
    assert len(ds.train) == 50 and len(ds.train.references[0]) in (8, 16)


@pytest.mark.parametrize(
    "name,make,classes",
    [
        ("caltech101", "make_caltech101", ["face", "airplane", "ant"]),
        ("oxford-pets", "make_oxford_pets", ["Abyssinian", "American Bulldog"]),
        ("food101", "make_food101", ["apple pie", "baby back ribs"]),
        ("dtd", "make_dtd", ["banded", "blotchy", "braided"]),
        ("cifar10", "make_cifar10", None),
        ("flowers102", "make_flowers102", None),
    ],
)
def test_a_real_format_tree_loads_every_label_and_split_right(tmp_path, monkeypatch, name, make, classes):
    """Each image's pixels encode its class and split (tests/formats.py): every label the loader
    gives, and every split it puts an image in, is checked against them."""
    import torchvision.datasets as tvd

    import tests.formats as formats

    for module in (tvd.cifar, tvd.flowers102):  # torchvision's md5 check of the real archives' files
        monkeypatch.setattr(module, "check_integrity", lambda *a, **k: True)
    getattr(formats, make)(tmp_path)
    data = load_dataset(name, data_root=str(tmp_path), test_fraction=0.34)
    if classes is not None:
        assert data.classnames == classes
    for source, split in ((data.train, "train"), (data.test, "test")):
        assert len(source) > 0
        for i in range(len(source)):
            label, encoded_split = formats.decode(source.image(i))
            assert label == int(source.labels[i]), (name, split, i)
            if name != "caltech101":  # Caltech101 has no official split: ours is a seeded stratified one
                assert encoded_split == split, (name, split, i)


def test_the_catalogue_is_what_the_config_accepts_and_the_loaders_dispatch(tmp_path):
    """One list of datasets (runconfig.datasets): the schema's choices, the loaders' dispatch and
    the data-root rule read it; a file-backed set with an empty root fails for its files, never
    as an unknown name; every entry's loader exists and takes its request."""
    import inspect

    from fedvlm.data.vlm_data import VLMDataError, load_vlm_dataset
    from fedvlm.runconfig import KEY_BY_NAME, datasets
    from fedvlm.utils.imports import load

    assert KEY_BY_NAME["dataset"].choices == ("auto", *datasets.NAMES)
    for entry in datasets.CATALOGUE:
        assert list(inspect.signature(load(entry.loader)).parameters) == ["request"], entry.name
        assert not entry.shadow or datasets.BY_NAME[entry.shadow].loader == entry.loader, entry.name
    for name in datasets.NEEDING_ROOT - datasets.IMAGE_TEXT:
        with pytest.raises(DatasetError) as err:
            load_dataset(name, data_root=str(tmp_path))
        assert "unknown dataset" not in str(err.value), name
    for name in datasets.IMAGE_TEXT - datasets.NEEDING_ROOT - datasets.OPTIONAL_ROOT:
        assert len(load_vlm_dataset(name).train) > 0, name
    with pytest.raises(VLMDataError, match="unknown dataset 'caltech101' for this family; accepted: embedded-captions"):
        load_vlm_dataset("caltech101")
    with pytest.raises(DatasetError, match="unknown dataset 'coco-captions' for this family; accepted: embedded,"):
        load_dataset("coco-captions")


def test_files_an_operator_can_get_wrong_are_named_with_the_fix(tmp_path, monkeypatch):
    """Issue 45: a non-UTF-8 classes.txt or file name, or a decompression bomb, failed without the
    file's name (a bomb's own exception class escaped the loader's)."""
    import os

    from fedvlm.utils.files import UnreadableFile

    _write_folder(tmp_path / "site", ["cat", "ant"], n=3)
    (tmp_path / "site" / "classes.txt").write_bytes("cat\nant\nb\xe9e\n".encode("latin-1"))
    with pytest.raises(UnreadableFile, match=r"classes.txt is not UTF-8 text \(byte 9: .*\): save it as UTF-8"):
        load_dataset("image-folder", data_root=str(tmp_path / "site"))
    (tmp_path / "site" / "classes.txt").unlink()
    Image.new("RGB", (20, 20)).save(os.path.join(os.fsencode(tmp_path / "site" / "cat"), b"caf\xe9.png"))
    with pytest.raises(DatasetError, match=r"the name b'.*caf\\xe9.png' is not UTF-8: rename it"):
        load_dataset("image-folder", data_root=str(tmp_path / "site"))

    _write_folder(tmp_path / "bomb" / "train", ["a", "b"], n=3)
    _write_folder(tmp_path / "bomb" / "test", ["a", "b"], n=1)
    d = load_dataset("image-folder", data_root=str(tmp_path / "bomb"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a 20 x 20 image is then past twice the limit
    with pytest.raises(DatasetError, match=rf"image {d.train.paths[0]} .*DecompressionBombError.*replace or remove it"):
        d.train.image(0)
