"""pFedMoAP's server (docs/methods.md, "pFedMoAP"): a pool of every node's latest prompt, and per-node
messages that carry the node's expert prompts.

Round t:
1. every expert choice of the round's training uses the pool as it was at the start of the
   round (the public code mutates the pool while its clients train in sequence): the train
   messages are all built before any reply enters the pool;
2. a sampled node that is not in the pool gets only the aggregate P_g (a plain CoOp round); a
   node in the pool gets P_g and ``experts`` [K', ...]: its K nearest other pool prompts by L2
   distance between the prompt tensors (float64, ties broken by node name; all of them when
   there are at most K), or K drawn at random (``pfedmoap.selection = 'random'``, seeded per
   node and round);
3. every accepted reply enters the pool, and P_g is their data-size-weighted mean (PromptFL's);
4. evaluation: a node in the pool gets its own pool prompt and experts chosen from the updated
   pool; any other node gets P_g.

The experts a node receives were uploaded by other nodes: each node's prompt reaches the server
and every peer that picks it, up to all of them in one round (K bounds the experts a node
receives, not how many nodes receive one prompt; docs/privacy.md).
"""

from __future__ import annotations

import numpy as np

from fedvlm.runconfig import ConfigError
from fedvlm.strategies.base import to_arrays, to_tensors
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Payload
from fedvlm.strategies.prompt import PromptFLStrategy
from fedvlm.strategies.records import ClientUpdate
from fedvlm.tensor_names import CTX, EXPERTS
from fedvlm.utils.rng import ServerStream, node_seed, numpy_rng, server_key


def nearest(own: np.ndarray, others: dict[str, np.ndarray], k: int) -> list[str]:
    """The ``k`` entries of ``others`` nearest to ``own`` by L2 distance (float64), ties by name."""
    own64 = np.asarray(own, dtype=np.float64)
    dist = {name: float(np.linalg.norm(np.asarray(p, dtype=np.float64) - own64)) for name, p in others.items()}
    return sorted(dist, key=lambda name: (dist[name], name))[:k]


class PFedMoAPStrategy(PromptFLStrategy):
    def __init__(self, parts: RunParts):
        super().__init__(parts)
        cfg = parts.cfg
        embed, dim = self.bundle.embed_dim, cfg.pfedmoap.gating_dim
        if dim > embed or embed % dim:
            raise ConfigError(
                f"run config 'pfedmoap.gating-dim' = {dim} must divide the embedding dimension {embed} of "
                f"{cfg.clip.model}: pick a divisor of {embed}"
            )
        self.pool: dict[str, np.ndarray] = {}  # node name -> its latest accepted prompt

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pool": to_tensors(self.pool)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.pool = to_arrays(state["pool"])

    def experts(self, node: NodeInfo, pool: dict[str, np.ndarray], server_round: int) -> list[str]:
        """The names of the pool prompts ``node`` gets as experts (none when it is not in ``pool``)."""
        if node.name not in pool:
            return []
        k = self.cfg.pfedmoap.k
        others = {name: p for name, p in pool.items() if name != node.name}
        if len(others) <= k:
            return sorted(others)
        if self.cfg.pfedmoap.selection == "random":
            key = server_key(
                self.cfg.seed, server_round, ServerStream.PFEDMOAP_EXPERTS, node_seed(node.partition_id, node.name)
            )
            return sorted(numpy_rng(key).choice(sorted(others), size=k, replace=False).tolist())
        return nearest(pool[node.name], others, k)

    def _with_experts(self, node: NodeInfo, own: dict[str, np.ndarray], server_round: int, phase: str) -> Payload:
        """``own`` and the node's experts from the pool (the names recorded in the round)."""
        names = self.experts(node, self.pool, server_round)
        experts = {EXPERTS: np.stack([self.pool[n] for n in names])} if names else {}
        return Payload({**own, **experts}, rows={f"{phase}/experts": names})

    def train_payload(self, node, server_round, arrays):
        payload = self._with_experts(node, arrays, server_round, "train")
        shared = self.spec.shares(self.cfg, arrays)
        payload.expected = {k: v.shape for k, v in arrays.items() if k in shared}
        return payload

    def evaluate_payload(self, node, server_round, arrays):
        if node.name not in self.pool:
            return Payload(dict(arrays))
        return self._with_experts(node, {CTX: self.pool[node.name]}, server_round, "eval")

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        for u in updates:
            self.pool[u.node.name] = np.asarray(u.reply.arrays[CTX])
        return super().aggregate(server_round, updates)
