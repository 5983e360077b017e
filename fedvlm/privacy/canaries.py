"""The one-run audit's canaries (``privacy.audit-canaries``): m extra records in the audited
node's training data, each present with probability 1/2 from OS entropy, and the score an
adversary who sees every noised step gives each of them.

The canaries are white-box *Dirac gradient canaries* (Nasr et al. 2023; Steinke, Nasr and
Jagielski 2023), the strongest record the DP-SGD threat model allows: a canary's per-sample
gradient is exactly C at one coordinate of every locally noised clip group and zero everywhere
else, so it survives clipping untouched and moves its coordinates by the full sensitivity C/B
each time its Poisson draw puts it in a batch. Each canary owns its coordinates alone (no two
share one), so their scores do not interfere. A canary's score is the sum, over the node's
private steps, of the noised gradient at its coordinates: what an adversary that sees every
iterate reads (for plain SGD, exactly what the shared updates reveal: the parameter change
divided by -lr). Members score C/B higher per step they were sampled in; the noise and the real
records' gradients at those coordinates are what hides them.

Where the records come from: the node reports n_real + m training records (public, independent
of which canaries are in); each step samples every one of the n_real + m record slots with the
planned rate q = B / (n_real + m), and the slot of an absent canary is simply empty. A present
canary is thus sampled exactly like a real record, and the sampling rate, batch divisor and
noise the accountant assumed hold as planned.

What the canaries cannot reach: tensors that are not noised on the node (DP-FPL's global prompt,
whose gradient the server noises): there a canary's gradient is zero, so the audit bounds the
node's local mechanism only. Per-batch clipping (``privacy.clipping = per-batch``): a canary's
gradient is as large as the batch's clip lets it be (C at its coordinates), which is what that
mechanism really allows a record.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedvlm.privacy.audit import AuditResult, CanaryError, audit_guesses

_INCLUDED, _SCORES, _STEPS, _COORD = "included", "scores", "steps", "coord."


def os_rng() -> np.random.Generator:
    """256 bits from the OS's secure generator: nobody, the server included, can replay it."""
    return np.random.default_rng(np.random.SeedSequence(secrets.randbits(256)))


@dataclass
class Canaries:
    """One node's canaries across rounds: which are present (secret), their coordinates, their
    scores so far. State in and out through ``state_dict`` / ``from_state_dict``."""

    included: np.ndarray  # [m] bool: S_i, present in the training data
    coords: dict[str, np.ndarray] = field(default_factory=dict)  # tensor -> [m] flat index, -1: none there
    scores: np.ndarray | None = None  # [m] float64
    steps: int = 0  # private steps observed

    def __post_init__(self):
        if self.scores is None:
            self.scores = np.zeros(self.m, dtype=np.float64)

    @classmethod
    def draw(cls, m: int, rng: np.random.Generator | None = None) -> Canaries:
        """m canaries, each present with probability 1/2 (from OS entropy unless a test gives ``rng``)."""
        if m < 1:
            raise CanaryError(f"an audit needs at least one canary, got privacy.audit-canaries = {m}")
        return cls((rng or os_rng()).random(m) < 0.5)

    @property
    def m(self) -> int:
        return len(self.included)

    # ---- sampling ----------------------------------------------------------------------------
    def split(self, batch: np.ndarray, n_real: int) -> tuple[np.ndarray, np.ndarray]:
        """A step's sampled slots -> (real record indices, ids of the present canaries sampled).
        Slots n_real .. n_real + m - 1 are the canaries'."""
        batch = np.asarray(batch)
        ids = batch[batch >= n_real] - n_real
        return batch[batch < n_real], ids[self.included[ids]]

    # ---- coordinates ---------------------------------------------------------------------------
    def place(
        self,
        shapes: Mapping[str, torch.Size],
        groups: Sequence[Sequence[str]],
        noised: frozenset[str],
        rng: np.random.Generator | None = None,
    ) -> None:
        """Give every canary its own coordinate in each locally noised clip group not placed yet
        (a group may appear in a later round, e.g. pFedMoAP's gate once it has experts). A group
        smaller than m holds coordinates for a random subset of the canaries."""
        eligible = [g for g in groups if all(k in noised for k in g)]
        if not eligible:
            raise CanaryError(
                "privacy.audit-canaries is set but none of the tensors this node trains is noised on the node "
                f"({', '.join(k for g in groups for k in g)}); the audit reaches local DP-SGD mechanisms only"
            )
        sizes = {k: int(np.prod(shapes[k], dtype=np.int64)) for g in eligible for k in g}
        largest = max(sum(sizes[k] for k in g) for g in eligible)
        if largest < self.m:
            raise CanaryError(
                f"privacy.audit-canaries = {self.m} canaries need one coordinate each, but the largest noised "
                f"clip group holds {largest}; use privacy.audit-canaries <= {largest}"
            )
        rng = rng or os_rng()
        for group in eligible:
            if any(k in self.coords for k in group):
                continue
            total = sum(sizes[k] for k in group)
            owners = rng.permutation(self.m)[: min(self.m, total)]
            flat = rng.choice(total, size=len(owners), replace=False)
            offset = 0
            for k in group:
                coord = np.full(self.m, -1, dtype=np.int64)
                inside = (flat >= offset) & (flat < offset + sizes[k])
                coord[owners[inside]] = flat[inside] - offset
                self.coords[k] = coord
                offset += sizes[k]

    # ---- the canaries' gradients -------------------------------------------------------------
    def per_sample(self, ids: np.ndarray, shapes: Mapping[str, torch.Size], clip: float, device) -> dict:
        """[len(ids), *shape] per tensor: C at each canary's coordinates, zero elsewhere."""
        out = {}
        for k, shape in shapes.items():
            rows = torch.zeros((len(ids), int(np.prod(shape, dtype=np.int64))), device=device)
            coord = self.coords.get(k)
            if coord is not None and len(ids):
                at = coord[ids]
                has = np.flatnonzero(at >= 0)
                rows[torch.as_tensor(has, device=device), torch.as_tensor(at[has], device=device)] = clip
            out[k] = rows.view(len(ids), *shape)
        return out

    def with_canaries(
        self, samples: Mapping[str, torch.Tensor], ids: np.ndarray, shapes: Mapping[str, torch.Size], clip: float
    ) -> dict[str, torch.Tensor]:
        """The real records' per-sample gradients with the sampled canaries' rows appended."""
        if not len(ids):
            return dict(samples)
        device = next(iter(samples.values())).device
        rows = self.per_sample(ids, shapes, clip, device)
        return {k: torch.cat([v, rows[k].to(v.dtype)]) for k, v in samples.items()}

    def into_batch(
        self, grads: Mapping[str, torch.Tensor], n_real: int, ids: np.ndarray, clip: float
    ) -> dict[str, torch.Tensor]:
        """Per-batch clipping: the batch's mean gradient with the sampled canaries in it. Without a
        per-record clip a record's gradient can be arbitrarily large; a canary's is taken as
        large as its share of the batch mean being C at its coordinates."""
        if not len(ids):
            return dict(grads)
        shapes = {k: v.shape for k, v in grads.items()}
        rows = self.per_sample(ids, shapes, clip, next(iter(grads.values())).device)
        share = n_real / (n_real + len(ids))
        return {k: v * share + rows[k].sum(0).to(v.dtype) for k, v in grads.items()}

    # ---- scores and the audit ------------------------------------------------------------------
    def observe(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one private step's released (noised) gradients at each canary's coordinates."""
        assert self.scores is not None  # set in __post_init__
        for k, coord in self.coords.items():
            if k not in grads:
                continue
            has = np.flatnonzero(coord >= 0)
            values = grads[k].detach().reshape(-1)[torch.as_tensor(coord[has], device=grads[k].device)]
            self.scores[has] += values.double().cpu().numpy()
        self.steps += 1

    def audit(self, delta: float, confidence: float = 0.95) -> AuditResult:
        assert self.scores is not None  # set in __post_init__
        return audit_guesses(self.scores, self.included, delta, confidence)

    # ---- state in and out --------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        assert self.scores is not None  # set in __post_init__
        out = {
            _INCLUDED: torch.from_numpy(self.included.astype(np.int64)),
            _SCORES: torch.from_numpy(self.scores.copy()),
            _STEPS: torch.tensor([self.steps], dtype=torch.int64),
        }
        out.update({_COORD + k: torch.from_numpy(v.copy()) for k, v in self.coords.items()})
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> Canaries:
        return cls(
            state[_INCLUDED].numpy().astype(bool),
            {k[len(_COORD) :]: v.numpy().astype(np.int64) for k, v in state.items() if k.startswith(_COORD)},
            state[_SCORES].numpy().astype(np.float64),
            int(state[_STEPS][0]),
        )
