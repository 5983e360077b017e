"""Membership candidates and the training sets of online-LiRA reference federations."""

from __future__ import annotations

import numpy as np
import pytest

from fedvlm.data.membership import membership_candidates, reference_inclusion, reference_node_data
from fedvlm.data.partitioners import Partition
from fedvlm.data.sources import ArraySource, DatasetSplits


def _splits_and_part():
    rng = np.random.default_rng(0)
    train = ArraySource(rng.integers(0, 255, (40, 4, 4, 3), dtype=np.uint8), np.arange(40) % 4, "toy/train")
    test = ArraySource(rng.integers(0, 255, (30, 4, 4, 3), dtype=np.uint8), np.arange(30) % 4, "toy/test")
    part = Partition(train=np.arange(5, 35), test=np.arange(0, 30, 2), neighbor=None, classes=(0, 1, 2, 3))
    return DatasetSplits("toy", ["a", "b", "c", "d"], train, test), part


def test_candidates_are_balanced_disjoint_and_repeatable():
    _, part = _splits_and_part()
    members, non_members = membership_candidates(part, seed=3, partition_id=1)
    assert len(members) == len(non_members) == 15  # the smaller of 30 train and 15 test records
    assert set(members) <= set(part.train) and set(non_members) <= set(part.test)
    again = membership_candidates(part, seed=3, partition_id=1)
    assert all(np.array_equal(a, b) for a, b in zip((members, non_members), again, strict=True))
    other = membership_candidates(part, seed=3, partition_id=2)[0]
    assert not np.array_equal(members, other)


@pytest.mark.parametrize("pairs", [1, 3])
def test_references_come_in_complementary_halves(pairs):
    _, part = _splits_and_part()
    inside = np.stack([reference_inclusion(part, 0, 1, j) for j in range(2 * pairs)])  # [R, 30]
    assert (inside.sum(1) == 15).all()  # each reference: half of the 30 candidates
    assert (inside.sum(0) == pairs).all()  # each candidate: in exactly R/2 references
    for j in range(0, 2 * pairs, 2):
        assert not (inside[j] & inside[j + 1]).any()
    if pairs > 1:  # the pairs differ from one another
        assert not np.array_equal(inside[0], inside[2])


def test_reference_node_trains_on_non_candidates_plus_its_half():
    splits, part = _splits_and_part()
    members, non_members = membership_candidates(part, 0, 1)
    inside = reference_inclusion(part, 0, 1, 1)
    pooled, ref_part = reference_node_data(splits, part, 0, 1, 1)
    offset = len(splits.train)
    trained = set(ref_part.train.tolist())
    assert set(np.setdiff1d(part.train, members)) <= trained  # the target's other records stay in
    for j, rec in enumerate(np.r_[members, offset + non_members]):
        assert (rec in trained) == inside[j]
    assert len(ref_part.train) == len(part.train)  # as many records as the target trained on
    # the pooled source serves train images first, then test images, under their own labels
    t = int(non_members[0])
    assert np.array_equal(np.asarray(pooled.train.image(offset + t)), np.asarray(splits.test.image(t)))
    assert pooled.train.labels[offset + t] == splits.test.labels[t]
    assert np.array_equal(ref_part.test, part.test) and pooled.test is splits.test
    assert pooled.train.identity != splits.train.identity  # its feature cache is its own
