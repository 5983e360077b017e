"""The strategy base every method builds on (a Flower Message-API ``Strategy``).

What it adds to Flower's ``Strategy``:
- a node registry from a handshake (``query`` message): every node reports its name, data
  sizes and backbone fingerprint before training; nodes that fail are excluded with their
  error, and the run stops before round 1 if fewer than ``min-nodes`` remain;
- seeded client sampling over node names, so the same config samples the same clients in
  simulation and deployment;
- per-node messages: a subclass decides what each node receives (``train_payload``) and
  what it must send back (``reply_shapes``), e.g. FedRand's per-node half;
- reply validation: a reply with an error, wrong tensors or shapes, a non-float dtype or
  non-finite values is dropped with a logged, recorded reason; the round goes on;
- the round loop, which records every round (metrics, seconds, bytes) before the next.

Subclasses implement ``initial_arrays`` and ``aggregate`` and may override the payload hooks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedvlm.methods.spec import MethodSpec
from fedvlm.privacy.accounting import BudgetError
from fedvlm.privacy.ledger import PrivacyLedger, PrivacySettings
from fedvlm.privacy.planner import ClientShape, GlobalDP, PrivacyPlanner
from fedvlm.protocol import SERVER_ROUND, EvaluateInstruction, HelloReport, TrainInstruction
from fedvlm.runconfig import RunConfig
from fedvlm.server_app.results import RunRecorder, progress_line
from fedvlm.strategies.validation import ReplyRejected, check_reply, record_nbytes, short_reason
from fedvlm.utils.rng import ServerStream, numpy_rng, server_key

log = logging.getLogger(__name__)




class FederationError(RuntimeError):
    """The federation cannot run (too few healthy nodes, mismatched backbones...)."""


@dataclass
class NodeInfo:
    node_id: int
    name: str
    partition_id: int
    num_train: int
    num_test: int
    num_neighbor: int
    backbone: str
    num_classes: int
    info: dict = field(default_factory=dict)


@dataclass
class ClientUpdate:
    node: NodeInfo
    arrays: dict[str, np.ndarray]
    metrics: dict


class FederatedStrategy(Strategy):
    def __init__(self, cfg: RunConfig, spec: MethodSpec):
        self.cfg = cfg
        self.spec = spec
        self.nodes: dict[int, NodeInfo] = {}
        self.failed_nodes: dict[int, str] = {}
        self.global_arrays: dict[str, np.ndarray] = {}  # set after the handshake (initial_arrays)
        self._expected: dict[int, dict[str, tuple]] = {}
        self._round: dict = {}
        self.server_fingerprint: str | None = None
        self.publish_dir: Path | None = None
        self.privacy = PrivacySettings.from_config(cfg)
        self.ledger = PrivacyLedger(self.privacy, spec.name)
        self.planner: PrivacyPlanner | None = None  # set once the nodes are known (plan_privacy)
        self.rounds_trained: dict[str, int] = {}  # node name -> rounds it was sent a train message

    # ---- hooks for methods -----------------------------------------------------------------
    def initial_arrays(self) -> dict[str, np.ndarray]:
        """The shared arrays before round 1; called once the nodes are known."""
        return {}

    def num_classes(self) -> int:
        """The class count every node reported in the handshake."""
        return next(iter(self.nodes.values())).num_classes

    def num_rounds(self) -> int:
        return self.cfg["num-server-rounds"]

    def train_payload(self, node: NodeInfo, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent to ``node`` for training (default: every global array)."""
        return dict(self.global_arrays)

    def reply_shapes(self, node: NodeInfo, server_round: int) -> dict[str, tuple]:
        """Tensors ``node`` must send back, with shapes (default: the shared global arrays)."""
        return {k: v.shape for k, v in self.global_arrays.items() if k in self.spec.shares(self.cfg, self.global_arrays)}

    def evaluate_payload(self, node: NodeInfo, server_round: int) -> dict[str, np.ndarray]:
        return dict(self.global_arrays)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Fold the validated updates into ``self.global_arrays``."""

    def on_finish(self, recorder: RunRecorder) -> None:
        """Called once after the last round, before the results are finalised."""

    def on_reply_accepted(self, node: NodeInfo, phase: str) -> None:
        """Called for every reply that passed validation (phase: 'train' or 'evaluate')."""

    def local_sigma(self, node: NodeInfo) -> float | None:
        """The std of ``node``'s local-DP noise this round (None: no local DP)."""
        if self.planner is not None and self.planner.local is not None:
            return self.planner.local_sigma(node.name)
        return None

    def nodes_per_round(self) -> int:
        """Clients sampled for training each round (the fixed denominator of a DP average)."""
        return min(len(self.nodes), max(1, math.ceil(self.cfg["fraction-train"] * len(self.nodes))))

    # ---- nodes -----------------------------------------------------------------------------
    def _connected(self, grid: Grid) -> list[int]:
        return sorted(grid.get_node_ids())

    def handshake(self, grid: Grid, node_ids: Iterable[int]) -> None:
        node_ids = [n for n in node_ids if n not in self.nodes and n not in self.failed_nodes]
        if not node_ids:
            return
        msgs = [Message(RecordDict({"config": ConfigRecord({SERVER_ROUND: 0})}), dst_node_id=n,
                        message_type=MessageType.QUERY) for n in node_ids]
        replies = {m.metadata.src_node_id: m for m in grid.send_and_receive(msgs, timeout=self.cfg["round-timeout"])}
        for n in node_ids:
            msg = replies.get(n)
            if msg is None:
                self.failed_nodes[n] = "no reply to the handshake within round-timeout"
            elif msg.has_error():
                self.failed_nodes[n] = short_reason(msg.error.reason)
            else:
                m, info = dict(msg.content["metrics"]), dict(msg.content["info"])
                self.ledger.note_released("handshake", [*m, *info])
                hello = HelloReport.from_records(info, m)
                node = NodeInfo(n, hello.name, hello.partition_id, hello.num_train, hello.num_test,
                                hello.num_neighbor, hello.backbone, hello.num_classes, info)
                known = next(iter(self.nodes.values()), None)
                if self.server_fingerprint and node.backbone != self.server_fingerprint:
                    self.failed_nodes[n] = (f"backbone {node.backbone} differs from the server's "
                                            f"{self.server_fingerprint}: every node must load the same weights")
                elif known is not None and node.num_classes != known.num_classes:
                    self.failed_nodes[n] = (f"it has {node.num_classes} classes but {known.name} has "
                                            f"{known.num_classes}: every node must use the same class list")
                elif known is not None and known.info.get("class-list") != node.info.get("class-list"):
                    self.failed_nodes[n] = (f"its class list differs from {known.name}'s (same number, other names or "
                                            f"order): give every node the same classes.txt")
                elif any(o.name == node.name for o in self.nodes.values()):
                    self.failed_nodes[n] = f"another node already uses the name {node.name!r}"
                else:
                    self.nodes[n] = node
                    log.info("node %s joined: %d train / %d test images", node.name, node.num_train, node.num_test)
            if n in self.failed_nodes:
                log.error("node %d excluded: %s", n, self.failed_nodes[n])

    def wait_for_nodes(self, grid: Grid) -> None:
        need = self.cfg["min-nodes"]
        t0, last = time.time(), -1
        while True:
            connected = self._connected(grid)
            self.handshake(grid, connected)
            healthy = [n for n in connected if n in self.nodes]
            if len(healthy) >= need:
                return
            # Stop now if every connected node failed (a config or data error they all share),
            # or if nodes failed and no more may join; otherwise wait for stragglers.
            everyone_failed = bool(connected) and not healthy
            if self.failed_nodes and (everyone_failed or not self._more_may_join(t0)):
                reasons: dict[str, list[str]] = {}
                for n, r in self.failed_nodes.items():
                    reasons.setdefault(r, []).append(self.nodes[n].name if n in self.nodes else str(n))
                detail = "\n".join(f"  {len(ids)} node(s) ({', '.join(ids[:4])}{'...' if len(ids) > 4 else ''}): {r}"
                                   for r, ids in reasons.items())
                raise FederationError(
                    f"only {len(healthy)} healthy node(s), {need} needed (min-nodes); excluded nodes:\n{detail}"
                )
            if len(connected) != last:
                log.info("waiting for nodes: %d connected, %d healthy, %d needed", len(connected), len(healthy), need)
                last = len(connected)
            time.sleep(1.0)

    def _more_may_join(self, t0: float) -> bool:
        # In simulation every node exists from the start; in deployment give stragglers the
        # round timeout to connect before giving up.
        return time.time() - t0 < self.cfg["round-timeout"]

    def sample(self, grid: Grid, server_round: int, fraction: float, stream: ServerStream) -> list[NodeInfo]:
        """Seeded choice over the healthy connected nodes, ordered by name."""
        connected = set(self._connected(grid))
        self.handshake(grid, connected)  # nodes that joined since the last round
        self.admit_late_nodes()
        pool = sorted((n for i, n in self.nodes.items() if i in connected), key=lambda n: n.name)
        if len(pool) < self.cfg["min-nodes"]:
            gone = sorted(n.name for i, n in self.nodes.items() if i not in connected)
            raise FederationError(
                f"round {server_round}: only {len(pool)} healthy node(s) still connected, fewer than min-nodes = "
                f"{self.cfg['min-nodes']}" + (f" (disconnected: {', '.join(gone[:8])})" if gone else "")
                + "; restart the missing SuperNodes, or lower min-nodes to let the run go on with fewer")
        k = min(len(pool), max(1, math.ceil(fraction * len(pool))))
        rng = numpy_rng(server_key(self.cfg["seed"], server_round, stream))
        chosen = rng.choice(len(pool), size=k, replace=False)
        return [pool[i] for i in sorted(chosen)]

    # ---- Flower Strategy API ---------------------------------------------------------------
    def _messages(self, nodes: list[NodeInfo], server_round: int, kind: str) -> list[Message]:
        msgs, down = [], 0
        for node in nodes:
            if kind == MessageType.TRAIN:
                payload = self.train_payload(node, server_round)
                expected = self.reply_shapes(node, server_round)
            else:
                payload, expected = self.evaluate_payload(node, server_round), {}
            self._expected[node.node_id] = expected
            down += record_nbytes(payload)
            phase_key = "train" if kind == MessageType.TRAIN else "evaluate"
            self._round.setdefault("clients", {}).setdefault(node.name, {})[f"{phase_key}/bytes_down"] = record_nbytes(payload)
            if kind == MessageType.TRAIN:
                shape = self.client_shape(node)
                config = TrainInstruction(server_round, tuple(sorted(expected)), shape.steps, shape.batch_size,
                                          node.num_train, self.local_sigma(node)).to_config()
            else:  # on the last evaluation clients publish their personalised prompts (client_app.publishing)
                final = bool(self._round.get("final"))
                config = EvaluateInstruction(server_round, final, str(self.publish_dir or "") if final else "").to_config()
            content = RecordDict({
                "arrays": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.items()}),
                "config": ConfigRecord(config),
            })
            msgs.append(Message(content, dst_node_id=node.node_id, message_type=kind))
        self._round["bytes_down"] = self._round.get("bytes_down", 0) + down
        phase = "train" if kind == MessageType.TRAIN else "evaluate"
        self._round.setdefault("bytes", {})[f"{phase}_down"] = down
        self._last_sent = msgs  # their ids are set when the grid pushes them; see _sender
        return msgs

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        nodes = self.sample(grid, server_round, self.cfg["fraction-train"], ServerStream.TRAIN_SAMPLE)
        self._round["sampled"] = len(nodes)
        return self._messages(nodes, server_round, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        nodes = self.sample(grid, server_round, self.cfg["fraction-evaluate"], ServerStream.EVALUATE_SAMPLE)
        return self._messages(nodes, server_round, MessageType.EVALUATE)

    def _sender(self, reply: Message) -> int:
        """The node a reply concerns. An error the SuperLink writes itself (e.g. 'Node Unavailable'
        for a SuperNode that stopped sending heartbeats) comes from the SuperLink's own id: map it
        back through the message it answers."""
        nid = reply.metadata.src_node_id
        if nid not in self.nodes:
            for sent in getattr(self, "_last_sent", []):
                if sent.metadata.message_id and sent.metadata.message_id == reply.metadata.reply_to_message_id:
                    return sent.metadata.dst_node_id
        return nid

    def _validated(self, replies: Iterable[Message], train: bool) -> list[ClientUpdate]:
        good = []
        for msg in replies:
            nid = self._sender(msg)
            node = self.nodes.get(nid)
            name = node.name if node else str(nid)
            try:
                arrays, metrics = check_reply(msg, self._expected.get(nid, {}), need_examples=train)
            except ReplyRejected as why:
                log.warning("round %s: dropped the %s reply of %s: %s", self._round.get("round"),
                            "train" if train else "evaluate", name, why)
                self._round.setdefault("dropped", []).append({"client": name, "phase": "train" if train else "evaluate", "reason": str(why)})
                continue
            self._round["bytes_up"] = self._round.get("bytes_up", 0) + record_nbytes(arrays)
            self.ledger.note_released("train" if train else "evaluate", metrics)
            if node is not None:
                self._round.setdefault("clients", {}).setdefault(name, {})[f"{'train' if train else 'evaluate'}/bytes_up"] = record_nbytes(arrays)
            key = f"{'train' if train else 'evaluate'}_up"
            self._round.setdefault("bytes", {})[key] = self._round["bytes"].get(key, 0) + record_nbytes(arrays)
            good.append(ClientUpdate(node, arrays, metrics))
            if node is not None:
                self.on_reply_accepted(node, "train" if train else "evaluate")
        return good

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        updates = self._validated(replies, train=True)
        for u in updates:
            self._round.setdefault("clients", {}).setdefault(u.node.name, {}).update(
                {f"train/{k}": v for k, v in u.metrics.items()})
        if updates:
            self.aggregate(server_round, updates)
        metrics = _weighted_metrics([u.metrics for u in updates], ("train-loss", "train-acc"))
        metrics["train-compute-seconds"] = float(sum(u.metrics.get("compute-seconds", 0.0) for u in updates))
        metrics["train-clients"] = len(updates)
        self._round.setdefault("metrics", {}).update(metrics)
        arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in self.global_arrays.items()})
        return arrays, MetricRecord(metrics)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        updates = self._validated(replies, train=False)
        for u in updates:
            self._round.setdefault("clients", {}).setdefault(u.node.name, {}).update(
                {f"eval/{k}": v for k, v in u.metrics.items()})
        metrics: dict = {}
        for tag in ("local", "neighbor"):
            accs = [u.metrics[f"{tag}-acc"] for u in updates if f"{tag}-acc" in u.metrics]
            if accs:
                # The papers average per-client accuracy; the weighted figure is kept too.
                metrics[f"{tag}-acc"] = float(np.mean(accs))
                metrics[f"{tag}-acc-std"] = float(np.std(accs))
                metrics.update(_weighted_metrics([u.metrics for u in updates], (f"{tag}-acc", f"{tag}-loss"),
                                                 weight_key=f"{tag}-n", suffix="-weighted"))
        metrics["eval-clients"] = len(updates)
        metrics["eval-compute-seconds"] = float(sum(u.metrics.get("compute-seconds", 0.0) for u in updates))
        self._round.setdefault("metrics", {}).update(metrics)
        return MetricRecord(metrics)

    def summary(self) -> None:
        log.info("%s: method %s, %d rounds, fraction-train %.2f, fraction-evaluate %.2f, seed %d",
                 type(self).__name__, self.spec.name, self.num_rounds(), self.cfg["fraction-train"],
                 self.cfg["fraction-evaluate"], self.cfg["seed"])

    # ---- privacy: one planner, composed per record (privacy.planner) ------------------------
    def global_dp(self) -> GlobalDP | None:
        """The method's server-side mechanism, if it has one."""
        return None

    def client_shape(self, node: NodeInfo) -> ClientShape:
        """``node``'s local training per round (batch size, steps): planned here, sent to it."""
        return self.spec.family.local_shape(self.cfg, node.num_train)

    def plan_privacy(self) -> None:
        """Plan every mechanism for the nodes known now (called once, before round 1)."""
        local = self.spec.local_dp(self.cfg) if self.spec.local_dp else None
        self.planner = PrivacyPlanner(self.privacy, self.ledger, self.num_rounds(), local, self.global_dp())
        if self.planner.global_dp is not None and self.cfg["privacy.noise-source"] == "seeded":
            secret = sorted(n.name for n in self.nodes.values() if n.info.get("noise-source") == "os")
            if secret:
                raise FederationError(
                    f"privacy.noise-source = 'seeded' makes the server's global noise regenerable by anyone with the "
                    f"run config, while {', '.join(secret[:4])} draw their own noise from the OS (real data): "
                    "use privacy.noise-source = 'auto' or 'os'")
        self.planner.plan({n.name: self.client_shape(n) for n in self.nodes.values()})

    def admit_late_nodes(self) -> None:
        """Plan the nodes that joined after round 1's plan; exclude one the plan cannot cover."""
        if self.planner is None:
            return
        for nid, node in list(self.nodes.items()):
            if node.name in self.planner.clients:
                continue
            try:
                if self.planner.global_dp is not None and self.cfg["privacy.noise-source"] == "seeded" \
                        and node.info.get("noise-source") == "os":
                    raise BudgetError("it draws OS noise but privacy.noise-source = 'seeded' makes the server's "
                                      "global noise regenerable")
                self.planner.admit(node.name, self.client_shape(node))
            except BudgetError as why:
                del self.nodes[nid]
                self.failed_nodes[nid] = str(why)
                log.error("node %s excluded: %s", node.name, why)

    def epsilon_entry(self, extra: dict[str, int] | None = None) -> dict:
        """What a record of each client has spent, every mechanism it feeds composed, for the
        rounds counted so far (plus ``extra`` rounds per client)."""
        extra = extra or {}
        per = {name: self.planner.epsilon(name, self.rounds_trained.get(name, 0) + extra.get(name, 0))
               for name in sorted(self.planner.clients)}
        entry: dict = {"epsilon": max(per.values(), default=0.0), "per_client": per}
        # each mechanism on its own, for comparison with papers that report them separately
        components: dict = {}
        for name, plan in self.planner.local_plans.items():
            steps = self.planner.clients[name].steps
            components.setdefault(plan.name, {})[name] = plan.epsilon_after(self.rounds_trained.get(name, 0) * steps)
        if self.planner.global_plan is not None:
            g = self.planner.global_plan
            components[g.name] = g.epsilon_after(max(self.rounds_trained.values(), default=0))
        entry["components"] = components
        return entry

    def check_budget_before_start(self) -> None:
        cap = self.privacy.max_epsilon
        if self.privacy.fixed_noise or not cap:  # a budget-limited run stops when the cap is reached
            return
        planned = self.planner.worst_planned()
        if planned > cap * (1 + 1e-9):
            raise BudgetError(
                f"the privacy plan would spend epsilon = {planned:.4g} per record over {self.num_rounds()} rounds, above "
                f"privacy.max-epsilon = {cap}; lower num-server-rounds or prompt.local-steps, raise "
                f"privacy.max-epsilon, or use privacy.calibration='accountant' with privacy.epsilon <= {cap}"
            )

    def round_would_exceed(self, nodes: list[NodeInfo]) -> float | None:
        """The worst per-record epsilon a round training ``nodes`` would bring, if it crosses
        max-epsilon."""
        cap = self.privacy.max_epsilon
        if not (self.privacy.enabled and cap and nodes):
            return None
        worst = self.epsilon_entry({n.name: 1 for n in nodes})["epsilon"]
        return worst if worst > cap * (1 + 1e-9) else None

    def server_noise_source(self) -> str:
        """Randomness of the server's own noise (privacy.mechanisms.NOISE_SOURCES): with 'auto',
        secret as soon as one node protects its own noise that way, since clients know the
        run seed and could otherwise regenerate the server's noise."""
        choice = self.cfg["privacy.noise-source"]
        if choice != "auto":
            return choice
        return "os" if any(n.info.get("noise-source") == "os" for n in self.nodes.values()) else "seeded"

    def record_noise_sources(self) -> None:
        clients = {n.name: str(n.info.get("noise-source", "seeded")) for n in self.nodes.values()}
        self.ledger.noise_sources = {"server": self.server_noise_source(), "clients": dict(sorted(clients.items()))}
        if "seeded" in (self.ledger.noise_sources["server"], *clients.values()):
            note = ("seeded noise (privacy.noise-source): derived from the run seed, so anyone who knows the run "
                    "config can regenerate and remove it; the epsilon holds only against parties without the "
                    "config. Use noise-source=os for real data")
            if note not in self.ledger.notes:
                self.ledger.notes.append(note)

    def record_privacy(self, server_round: int, recorder: RunRecorder) -> None:
        if not self.privacy.enabled:
            return
        entry = self.epsilon_entry()
        self.record_noise_sources()  # nodes may have joined since the last round
        self.ledger.record_round(server_round, entry)
        self._round.setdefault("metrics", {})["epsilon/per-record-max"] = entry["epsilon"]
        recorder.add_section("privacy", self.ledger.as_dict())

    # ---- the run ---------------------------------------------------------------------------
    def record_nodes(self, recorder: RunRecorder) -> None:
        nodes = [vars(n) | {"node_id": str(n.node_id)} for n in sorted(self.nodes.values(), key=lambda n: n.name)]
        excluded = {str(k): v for k, v in self.failed_nodes.items()}
        run = recorder.data["run"]
        if run.get("nodes") != nodes or run.get("excluded_nodes") != excluded:
            recorder.set_run_info(nodes=nodes, excluded_nodes=excluded)

    def run(self, grid: Grid, recorder: RunRecorder) -> dict:
        self.publish_dir = recorder.dir / "published"
        self.summary()
        self.wait_for_nodes(grid)
        self.global_arrays = {k: np.asarray(v) for k, v in self.initial_arrays().items()}
        self.record_nodes(recorder)
        if self.privacy.enabled:
            self.plan_privacy()
            self.record_noise_sources()
            recorder.add_section("privacy", self.ledger.as_dict())
            self.check_budget_before_start()
        timeout = self.cfg["round-timeout"]
        total = self.num_rounds()
        empty_cfg = ConfigRecord()
        status, note = "finished", ""
        rnd = 0
        for rnd in range(1, total + 1):
            t0 = time.time()
            self._round = {"round": rnd, "bytes_up": 0, "bytes_down": 0, "metrics": {}, "clients": {}, "dropped": [],
                           "final": rnd == total}
            current = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in self.global_arrays.items()})
            if self.spec.trains:
                messages = list(self.configure_train(rnd, current, empty_cfg, grid))
                trainees = [self.nodes[m.metadata.dst_node_id] for m in messages]
                over = self.round_would_exceed(trainees)
                if over is not None:
                    status = "stopped"
                    note = (f"privacy budget reached: round {rnd} would bring epsilon to {over:.4g}, above "
                            f"privacy.max-epsilon = {self.privacy.max_epsilon}; stopped after round {rnd - 1}")
                    log.warning(note)
                    rnd -= 1
                    # one more evaluation of the state reached, so that clients publish it
                    self._round = {"round": rnd, "final": True}
                    grid.send_and_receive(self.configure_evaluate(rnd, current, empty_cfg, grid), timeout=timeout)
                    break
                for node in trainees:  # spent when sent: a lost reply may still have been computed
                    self.rounds_trained[node.name] = self.rounds_trained.get(node.name, 0) + 1
                replies = grid.send_and_receive(messages, timeout=timeout)
                self.aggregate_train(rnd, replies)
            replies = grid.send_and_receive(self.configure_evaluate(rnd, current, empty_cfg, grid), timeout=timeout)
            self.aggregate_evaluate(rnd, replies)
            self.record_privacy(rnd, recorder)
            record = {"round": rnd, "metrics": self._round["metrics"], "seconds": round(time.time() - t0, 3),
                      "bytes_up": self._round["bytes_up"], "bytes_down": self._round["bytes_down"],
                      "bytes": self._round.get("bytes", {}), "clients": self._round["clients"], "dropped": self._round["dropped"]}
            recorder.add_round(record)
            self.record_nodes(recorder)  # nodes may have joined or been excluded since
            if self.global_arrays:
                recorder.save_arrays("checkpoint.pt", self.global_arrays, rnd)
            log.info(progress_line(record, total))
        if self.global_arrays:
            recorder.save_arrays("final_shared.pt", self.global_arrays, rnd)
        self.on_finish(recorder)
        return recorder.finish(status, note)


def _weighted_metrics(metrics: list[dict], keys: Iterable[str], weight_key: str = "num-examples", suffix: str = "") -> dict:
    out = {}
    for key in keys:
        pairs = [(m[key], m.get(weight_key, 0)) for m in metrics if key in m]
        total = sum(w for _, w in pairs)
        if pairs and total > 0:
            out[key + suffix] = float(sum(v * w for v, w in pairs) / total)
    return out
