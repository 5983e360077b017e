"""Server strategies of the LoRA family: FedAvg-LoRA, FedPer-LoRA, FedPara-LoRA and FedRand.

The server loads the frozen VLM once on the CPU (for the adapter's seeded initial values and
the fingerprint every client must match) and holds the shared adapter tensors. Every method
averages what it receives weighted by the clients' data sizes; FedRand does so per half.

FedRand (docs/methods.md, "FedRand"): each round the server draws a_k ~ Bernoulli(rho) for every sampled
client (seeded by run seed and round), sends only the drawn half (all A if a_k = 1, all B
otherwise; both on a client's first participation) and asks for that half back. Then

    A <- sum_{k: a_k=1} n_k A_k / sum_{k: a_k=1} n_k,   B likewise over a_k = 0,

and a half that no client returned stays as it was. The server also keeps every client's last
uploaded A and B: the client model it could reconstruct (the membership attack's second
threat), saved at the end of the run.
"""

from __future__ import annotations

import logging

import numpy as np

from fedvlm.metrics import FEDRAND_CLIENTS, TRAIN_CLIENTS
from fedvlm.models import adapter_parts
from fedvlm.models.vlm import load_vlm
from fedvlm.strategies.aggregation import per_group_average, weighted_average
from fedvlm.strategies.base import FederatedStrategy, to_arrays, to_tensors
from fedvlm.strategies.nodes import NodeInfo
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.plan import Payload
from fedvlm.strategies.records import ClientUpdate, RoundSum, RunOutputs
from fedvlm.utils.rng import ServerStream, node_seed, numpy_rng, server_key

log = logging.getLogger(__name__)


class LoRAStrategy(FederatedStrategy):
    """FedAvg-LoRA, FedPer-LoRA and FedPara-LoRA: the method's sharing rule picks the adapter
    tensors that travel (``MethodSpec.shares``); each is averaged weighted by data size."""

    def __init__(self, parts: RunParts):
        super().__init__(parts)
        cfg = parts.cfg
        _, initial, fp = load_vlm(cfg, self.spec.adapter, "cpu")
        self.registry.server_fingerprint = fp
        self.adapter_initial = {k: v.numpy() for k, v in initial.items()}
        self.shared_names = sorted(self.spec.shares(cfg, initial))
        self.last_upload: dict[str, dict[str, np.ndarray]] = {}  # client -> its latest uploaded tensors

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "last_upload": {name: to_tensors(up) for name, up in self.last_upload.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.last_upload = {name: to_arrays(up) for name, up in state["last_upload"].items()}

    def adapter_bytes(self) -> int:
        return int(sum(v.nbytes for v in self.adapter_initial.values()))

    def initial_arrays(self) -> dict[str, np.ndarray]:
        return {k: self.adapter_initial[k].copy() for k in self.shared_names}

    def train_payload(self, node: NodeInfo, server_round: int, arrays: dict[str, np.ndarray]) -> Payload:
        return Payload(dict(arrays), {k: v.shape for k, v in arrays.items()})

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        for u in updates:
            self.last_upload.setdefault(u.node.name, {}).update(u.reply.arrays)
        avg = weighted_average([u.reply.arrays for u in updates], [u.reply.num_examples for u in updates])
        self.global_arrays.update(avg)
        return {}

    def outputs(self, rounds: list[dict]) -> RunOutputs:
        """What the server could reconstruct of each client's model (its last uploads), and what
        the run's communication cost against sending the whole adapter."""
        full = self.adapter_bytes()
        up = sum(r["train_bytes_up"] for r in rounds)
        down = sum(r["train_bytes_down"] for r in rounds)
        trained = sum(r["metrics"].get(TRAIN_CLIENTS, 0) for r in rounds)
        sent = sum(r["sampled"] for r in rounds)  # train messages sent: a round is recorded once it was sent
        communication = {
            "adapter_bytes": full,
            "train_bytes_up": int(up),
            "train_bytes_down": int(down),
            "full_lora_bytes_up": int(full * trained),
            "full_lora_bytes_down": int(full * sent),
            "up_vs_full_lora": up / (full * trained) if trained else None,
            "down_vs_full_lora": down / (full * sent) if sent else None,
        }
        return RunOutputs(
            {f"reconstructed/{name}.pt": arrays for name, arrays in self.last_upload.items()},
            {"communication": communication},
        )


class FedRandStrategy(LoRAStrategy):
    def __init__(self, parts: RunParts):
        super().__init__(parts)
        self.halves = {h: adapter_parts.lora_half(self.shared_names, h) for h in adapter_parts.HALVES}
        # nodes sent a train message (the whole adapter, the first time): a lost reply counts, the
        # node may have trained and keeps what it was sent
        self.participated: set[str] = set()
        # round -> client -> half drawn ('A' | 'B'); a draw is keyed by seed, round and node, so a
        # resumed run draws the same halves without saving them
        self.draws: dict[int, dict[str, str]] = {}

    def draw(self, node: NodeInfo, server_round: int) -> str:
        """The half ``node`` gets this round: A with probability rho. Keyed by (seed, round, the
        node's seed) so the draw does not depend on which other clients were sampled."""
        per_round = self.draws.setdefault(server_round, {})
        if node.name not in per_round:
            key = server_key(
                self.cfg.seed, server_round, ServerStream.FEDRAND_HALF, node_seed(node.partition_id, node.name)
            )
            rng = numpy_rng(key)
            per_round[node.name] = "A" if rng.random() < self.cfg.fedrand.rho else "B"
        return per_round[node.name]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "participated": sorted(self.participated)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.participated = set(state["participated"])

    def train_payload(self, node: NodeInfo, server_round: int, arrays: dict[str, np.ndarray]) -> Payload:
        half = self.draw(node, server_round)
        first = node.name not in self.participated
        names = self.shared_names if first else self.halves[half]
        return Payload(
            {k: arrays[k] for k in names},
            {k: arrays[k].shape for k in self.halves[half]},
            {"fedrand/half": half, "fedrand/first": first},
        )

    def train_result(self, kept, updates, metrics):
        """Every node sent this round's training has now had the shared arrays once, whether its
        update came in the clear or inside a secure sum."""
        self.participated.update(o.node.name for o in kept.outgoing.values())
        return super().train_result(kept, updates, metrics)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, float]:
        for u in updates:
            self.last_upload.setdefault(u.node.name, {}).update(u.reply.arrays)
        chosen = [self.draws[server_round][u.node.name] for u in updates]
        for half in self.halves:
            if half not in chosen:
                log.info("round %d: no client returned half %s; it stays unchanged", server_round, half)
        self.global_arrays = per_group_average(
            self.global_arrays,
            self.halves,
            [u.reply.arrays for u in updates],
            [u.reply.num_examples for u in updates],
            chosen,
        )
        return {
            FEDRAND_CLIENTS[half]: sum(self.draws[server_round][u.node.name] == half for u in updates)
            for half in FEDRAND_CLIENTS
        }

    def aggregate_sums(self, server_round: int, total: RoundSum, updates: list[ClientUpdate]) -> dict[str, float]:
        """The per-tensor weighted average is the per-half one (paper eqs. 8-10); the survivors'
        halves, which the server drew, give the round's counts."""
        super().aggregate_sums(server_round, total, updates)
        chosen = [self.draws[server_round][self.nodes[n].name] for n in total.survivors if n in self.nodes]
        return {FEDRAND_CLIENTS[half]: chosen.count(half) for half in FEDRAND_CLIENTS}
