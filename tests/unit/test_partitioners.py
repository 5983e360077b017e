"""Partitioners: deterministic under a seed, disjoint, and of the promised sizes."""

from __future__ import annotations

import numpy as np
import pytest

from fedvlm.data.partitioners import PartitionError, make_partitions

N_CLASSES = 40
TRAIN = np.repeat(np.arange(N_CLASSES), 30)
TEST = np.repeat(np.arange(N_CLASSES), 10)


def _parts(name, n=10, seed=0, **kw):
    return make_partitions(name, TRAIN, TEST, N_CLASSES, n, seed, **kw)


@pytest.mark.parametrize("name", ["pathological", "dirichlet", "iid", "quantity-skew"])
def test_deterministic_and_disjoint(name):
    kw = {"ratios": ":".join(["3"] * 5 + ["1"] * 5)} if name == "quantity-skew" else {}
    a, b = _parts(name, **kw), _parts(name, **kw)
    for pa, pb in zip(a, b, strict=True):
        assert np.array_equal(pa.train, pb.train) and np.array_equal(pa.test, pb.test)
    train = np.concatenate([p.train for p in a])
    test = np.concatenate([p.test for p in a])
    assert len(train) == len(np.unique(train)) == len(TRAIN)  # disjoint and complete
    assert len(test) == len(np.unique(test)) == len(TEST)
    c = _parts(name, seed=1, **kw)
    assert any(not np.array_equal(x.train, y.train) for x, y in zip(a, c, strict=True))  # the seed matters


def test_pathological_blocks():
    parts = _parts("pathological")
    blocks = [set(p.classes) for p in parts]
    assert all(len(b) == 4 for b in blocks)
    assert set().union(*blocks) == set(range(N_CLASSES))
    for p in parts:
        assert set(TRAIN[p.train]) == set(p.classes) == set(TEST[p.test])
        assert not set(TEST[p.neighbor]) & set(p.classes)
        assert len(p.test) + len(p.neighbor) == len(TEST)
    # classes are shuffled, not handed out in order
    assert [sorted(b) for b in blocks] != [list(range(4 * i, 4 * i + 4)) for i in range(10)]


def test_pathological_too_many_clients():
    with pytest.raises(PartitionError, match="at least one class per client"):
        _parts("pathological", n=41)


def test_dirichlet_test_follows_train_mix():
    parts = _parts("dirichlet", alpha=0.3)
    for p in parts:
        assert p.neighbor is None
        train_classes = set(TRAIN[p.train])
        # test images only come from classes the client trains on (up to rounding)
        assert set(TEST[p.test]) <= train_classes
    # alpha=0.3 is strongly label-skewed: a client's top class holds far more than the 1/40
    # an IID split would give it.
    top_share = [np.bincount(TRAIN[p.train], minlength=N_CLASSES).max() / len(p.train) for p in parts]
    assert np.mean(top_share) > 0.1
    iid_share = [np.bincount(TRAIN[p.train], minlength=N_CLASSES).max() / len(p.train) for p in _parts("iid")]
    assert np.mean(iid_share) < 0.08


def test_iid_sizes():
    parts = _parts("iid")
    assert {len(p.train) for p in parts} == {120}
    assert {len(p.test) for p in parts} == {40}


def test_iid_with_more_clients_than_images_names_the_fix():
    with pytest.raises(PartitionError, match="raise embedded-per-class"):
        make_partitions("iid", TRAIN[:50], TEST[:50], N_CLASSES, 60, seed=0)


def test_embedded_per_class_gives_a_thousand_clients_data_and_keeps_the_default_cache_tag():
    from fedvlm.data.registry import load_dataset

    default, big = load_dataset("embedded"), load_dataset("embedded", embedded_per_class=128)
    assert len(default.train) == 40 * 64 and len(default.test) == 40 * 24
    assert len(big.train) == 40 * 128 and len(big.test) == 40 * 48
    assert np.bincount(big.train.labels).tolist() == [128] * 40
    # the default's features stay cached under their old identity; a larger draw has its own
    from fedvlm.data.embedded import domain_version

    assert default.train.identity == f"embedded-{domain_version()}/train"
    assert big.train.identity == f"embedded-128-{domain_version()}/train"
    parts = make_partitions("iid", big.train.labels, big.test.labels, 40, 1000, seed=0)
    assert min(len(p.train) for p in parts) == 5 and min(len(p.test) for p in parts) >= 1


def test_quantity_skew_ratios():
    parts = _parts("quantity-skew", n=3, ratios="45:9:1")
    sizes = np.array([len(p.train) for p in parts])
    assert sizes.sum() == len(TRAIN)
    np.testing.assert_allclose(sizes / sizes.sum(), np.array([45, 9, 1]) / 55, atol=2 / len(TRAIN))
    with pytest.raises(PartitionError, match="one ratio per client"):
        _parts("quantity-skew", n=4, ratios="45:9:1")
