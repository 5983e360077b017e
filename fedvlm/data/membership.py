"""The records a membership attack tests on one client, and the training sets of the online
reference federations that give LiRA its "in" models.

Candidates: k of the client's training records (members) and k of its test records (the same
classes, never trained on: non-members), k the smaller count, drawn from a seed. The attack
command and the reference federations both call ``membership_candidates``, so they agree on
which records are tested.

Online references (LiRA's online variant needs, for every tested record, models trained with it
and models trained without it): reference federation j trains like the target, except that each
node's training set is its training records outside the candidates plus one half of its
candidates, members and non-members pooled. References come in complementary pairs (2i, 2i+1)
over one seeded permutation, so with R references every candidate is "in" exactly R/2 times and
each reference trains on as many records as the target did.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fedvlm.data.partitioners import Partition
from fedvlm.data.sources import ConcatSource, DatasetSplits


def membership_candidates(part: Partition, seed: int, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(members, non-members): sorted indices into the train and the test split, equal in number."""
    rng = np.random.default_rng([seed, partition_id + 1])
    k = min(len(part.train), len(part.test))
    members = np.sort(rng.choice(part.train, size=k, replace=False))
    non_members = np.sort(rng.choice(part.test, size=k, replace=False))
    return members, non_members


def reference_inclusion(part: Partition, seed: int, partition_id: int, reference: int) -> np.ndarray:
    """[2k] bool: which candidates (members first, then non-members, as ``membership_candidates``
    orders them) reference federation ``reference`` trains on. Pairs (2i, 2i+1) are complementary."""
    members, _ = membership_candidates(part, seed, partition_id)
    pool = 2 * len(members)
    order = np.random.default_rng([seed, partition_id + 1, reference // 2, 7]).permutation(pool)
    inside = np.zeros(pool, bool)
    inside[order[: pool // 2] if reference % 2 == 0 else order[pool // 2 :]] = True
    return inside


def reference_node_data(
    splits: DatasetSplits, part: Partition, seed: int, partition_id: int, reference: int
) -> tuple[DatasetSplits, Partition]:
    """A node's data in online reference federation ``reference``: its train split extended by
    the test split, and its training indices = non-candidate training records + the included
    candidates. Test and neighbor records stay as they are (a reference's accuracy is not reported)."""
    members, non_members = membership_candidates(part, seed, partition_id)
    inside = reference_inclusion(part, seed, partition_id, reference)
    offset = len(splits.train)
    candidates = np.r_[members, offset + non_members]
    train = np.sort(np.r_[np.setdiff1d(part.train, members), candidates[inside]])
    pooled = replace(splits, train=ConcatSource(splits.train, splits.test))
    return pooled, replace(part, train=train)
