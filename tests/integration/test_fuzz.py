"""Every method against hostile and broken replies (tests/fuzz.py): the run finishes, each
corrupted reply is dropped with a reason naming its fault, a huge update is clipped to the
round's bound (or dropped, with replies.norm-action = 'reject'), a node with a broken handshake
(at the start or joining late) is excluded with its reason, the shared state stays finite and
results.json strict JSON."""

from __future__ import annotations

import pytest

from tests.fuzz import EVALUATE, HELLO, METHOD_CASES, TRAIN, fuzz

FAST = ("promptfl", "dpfpl", "reprogram")  # one per family's aggregation; the others are slow


@pytest.mark.parametrize("method", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in METHOD_CASES])
def test_every_corruption_is_dropped_or_bounded(method, cache_dir, pretrained_clip, request, tmp_path):
    if METHOD_CASES[method] in ("fedrand", "fedavg-lora", "fedper-lora", "fedpara-lora"):
        request.getfixturevalue("vlm_cache")
    outcomes = fuzz(method, cache_dir, tmp_path)
    expected = set(EVALUATE) | set(HELLO) | (set(TRAIN) if method != "zeroshot" else set())
    if method == "zeroshot":  # one round: no later round for a late joiner to join in
        expected -= {c for c in HELLO if c.startswith("late-")}
    if method == "coop":  # its replies carry no tensors: the tensor corruptions do not apply
        expected -= {c for c, (_, needs_tensor, _) in TRAIN.items() if needs_tensor}
    assert set(outcomes) == expected


def test_a_huge_update_is_dropped_when_the_run_says_reject(cache_dir, pretrained_clip, tmp_path):
    outcomes = fuzz("promptfl", cache_dir, tmp_path, **{"replies.norm-action": "reject"})
    assert (
        outcomes["huge-norm"].startswith("dropped: update norm")
        and "exceeds the round's bound" in outcomes["huge-norm"]
    )
