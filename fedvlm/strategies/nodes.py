"""The server's node registry: who the nodes are (a handshake before any training), waiting
for enough of them, and the seeded choice of each round's clients.

Every node answers a QUERY with its ``HelloReport`` (name, data sizes, backbone fingerprint,
class list); one whose backbone or classes differ from the others', or that fails, is excluded
with its own reason, and the run stops before round 1 if fewer than ``min-nodes`` remain.
Sampling is a seeded draw over node names, so the same config samples the same clients in
simulation and deployment.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedvlm.metrics import LOCAL_N, NEIGHBOR_N, NOVEL_N, NUM_EXAMPLES
from fedvlm.privacy.ledger import PrivacyLedger
from fedvlm.protocol import CONFIG_RECORD, SERVER_ROUND
from fedvlm.runconfig import RunConfig
from fedvlm.spec import spec_of
from fedvlm.strategies.validation import ReplyRejected, bounded, check_hello
from fedvlm.utils.rng import ServerStream, numpy_rng, server_key
from fedvlm.utils.runtime import simulated_grid

log = logging.getLogger(__name__)

# A handshake a node did not answer is asked again once before the node is excluded: under load
# a reply can be lost on the way (a SuperLink whose database is busy answers the SuperNode's
# push with an error, and the SuperNode does not push it again), and a node is no less healthy
# for it.
HANDSHAKE_TRIES = 2


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
    info: dict = field(default_factory=dict)  # its handshake's words as it stated them (for the record)
    num_partitions: int = 0  # a partition node's num-partitions; 0 for a node with its own data
    noise_source: str = "seeded"  # where its DP noise comes from, as its handshake said
    class_list: str = ""  # the digest of its class names in order (the prompt family)
    num_novel: int = 0  # its test records of novel classes (class-split base-to-novel)

    def evaluation_counts(self) -> dict[str, int]:
        """The most each record count of this node's evaluation may say (its handshake's sizes)."""
        return {
            NUM_EXAMPLES: self.num_test,
            LOCAL_N: self.num_test,
            NEIGHBOR_N: self.num_neighbor,
            NOVEL_N: self.num_novel,
        }


class NodeRegistry:
    def __init__(self, cfg: RunConfig, ledger: PrivacyLedger):
        self.cfg = cfg
        self.ledger = ledger  # what a node reveals in its handshake is recorded there
        self.nodes: dict[int, NodeInfo] = {}
        self.failed: dict[int, str] = {}  # node id -> why it was excluded
        self.unanswered: dict[int, int] = {}  # node id -> handshakes it has not answered yet
        self.server_fingerprint: str | None = None  # the backbone every node must load, where the server knows it
        self.connected: set[int] = set()  # the node ids connected at the last refresh (what a round samples from)

    def audited(self) -> NodeInfo | None:
        """The node that carries the one-run audit's canaries (partition id ``privacy.audit-node``),
        if it is among the admitted nodes."""
        wanted = self.cfg.privacy.audit_node
        return next((n for n in self.nodes.values() if n.partition_id == wanted), None)

    def exclude(self, node_id: int, reason: str) -> None:
        node = self.nodes.pop(node_id, None)
        reason = bounded(reason)  # it may quote what the node sent
        self.failed[node_id] = reason
        log.error("node %s excluded: %s", node.name if node else node_id, reason)

    def handshake(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Query the nodes not seen yet (``node_ids``: every connected node); admit or exclude each."""
        connected = set(node_ids)
        # in id order: which of two clashing nodes is admitted must not depend on set order
        node_ids = sorted(n for n in connected if n not in self.nodes and n not in self.failed)
        if not node_ids:
            return
        msgs = [
            Message(
                RecordDict({CONFIG_RECORD: ConfigRecord({SERVER_ROUND: 0})}),
                dst_node_id=n,
                message_type=MessageType.QUERY,
            )
            for n in node_ids
        ]
        replies = {m.metadata.src_node_id: m for m in grid.send_and_receive(msgs, timeout=self.cfg.round_timeout)}
        for n in node_ids:
            msg = replies.get(n)
            if msg is None:
                self.unanswered[n] = self.unanswered.get(n, 0) + 1
                if self.unanswered[n] >= HANDSHAKE_TRIES:
                    self.exclude(n, f"no reply to {HANDSHAKE_TRIES} handshakes, each within round-timeout")
                else:
                    log.warning("node %d did not answer the handshake within round-timeout; asking again", n)
            else:
                try:
                    hello = check_hello(msg)
                except ReplyRejected as bad:
                    self.exclude(n, str(bad))
                    continue
                info, numbers = hello.to_records()
                self.ledger.note_released("handshake", [*numbers, *info])
                node = NodeInfo(
                    n,
                    hello.name,
                    hello.partition_id,
                    hello.num_train,
                    hello.num_test,
                    hello.num_neighbor,
                    hello.backbone,
                    hello.num_classes,
                    info,
                    hello.num_partitions,
                    hello.noise_source,
                    hello.class_list,
                    hello.num_novel,
                )
                why = self._forget_restarted(node, connected) or self._mismatch(node)
                if why:
                    self.exclude(n, why)
                else:
                    self.nodes[n] = node
                    log.info("node %s joined: %d train / %d test images", node.name, node.num_train, node.num_test)

    def _forget_restarted(self, node: NodeInfo, connected: set[int]) -> str:
        """A node that answers under a new id with the name of one no longer connected is that node
        restarted (without SuperNode authentication a restart gets a new id): it replaces the
        old entry, keeping its name, and so its privacy budget and its place in the sampling.
        Unless it came back with another number of training records: the plan it was sent
        noise for, and what its records have spent, were accounted for the old number (a record
        of a smaller set is sampled more often), so it is refused (the reason; "" to go on)."""
        for old_id, old in list(self.nodes.items()):
            if old.name == node.name and old_id not in connected:
                if old.num_train != node.num_train:
                    return (
                        f"it rejoined as {node.name} with {node.num_train} training records, but the privacy its "
                        f"records have spent was planned and accounted for the {old.num_train} it had: restart it on "
                        "the data it had, or start a new run"
                    )
                log.info("node %s rejoined as node id %d (was %d)", node.name, node.node_id, old_id)
                del self.nodes[old_id]
        return ""

    def _mismatch(self, node: NodeInfo) -> str:
        known = next(iter(self.nodes.values()), None)
        if self.server_fingerprint and node.backbone != self.server_fingerprint:
            return (
                f"backbone {node.backbone} differs from the server's {self.server_fingerprint}: every node must "
                "load the same weights"
            )
        # a VLM node's split label only describes its data (nothing trains on it): classes need not agree
        if known is not None and not spec_of(self.cfg).family.image_text:
            why = self._class_mismatch(node, known)
            if why:
                return why
        if any(o.name == node.name for o in self.nodes.values()):
            return f"another node already uses the name {node.name!r}"
        return self._partition_mismatch(node)

    def _partition_mismatch(self, node: NodeInfo) -> str:
        """Partition nodes split one dataset: they must agree on how many parts, and hold
        different ones (two nodes on one part, or parts of different splits, overlap)."""
        if node.partition_id < 0:
            return ""
        for other in self.nodes.values():
            if other.partition_id < 0:
                continue
            if other.num_partitions != node.num_partitions:
                return (
                    f"it takes partition {node.partition_id} of {node.num_partitions}, but {other.name} takes one of "
                    f"{other.num_partitions}: the parts of different splits overlap; start every partition node with "
                    "the same num-partitions"
                )
            if other.partition_id == node.partition_id:
                return f"{other.name} already trains on partition {node.partition_id}: give each node its own"
        return ""

    @staticmethod
    def _class_mismatch(node: NodeInfo, known: NodeInfo) -> str:
        if node.num_classes != known.num_classes:
            return (
                f"it has {node.num_classes} classes but {known.name} has {known.num_classes}: every node must "
                "use the same class list"
            )
        if known.class_list != node.class_list:
            return (
                f"its class list differs from {known.name}'s (same number, other names or order): give every "
                "node the same classes.txt"
            )
        return ""

    def wait(self, grid: Grid) -> None:
        """Handshake connected nodes until ``min-nodes`` are healthy; stop with every reason if
        they cannot be: all failed, or no more can come (in simulation every node exists from
        the start, so as soon as each has answered; in deployment once the stragglers' time,
        round-timeout, is up)."""
        need = self.cfg.min_nodes
        sim = simulated_grid(grid)
        t0, last = time.time(), -1
        while True:
            connected = sorted(grid.get_node_ids())
            self.handshake(grid, connected)
            healthy = [n for n in connected if n in self.nodes]
            if len(healthy) >= need:
                return
            everyone_failed = bool(connected) and not healthy
            # every connected node has answered its handshake or been excluded (an unanswered one is
            # asked again, then excluded: that wait is bounded by the handshake's own tries)
            settled = all(n in self.nodes or n in self.failed for n in connected)
            if sim:
                no_more = settled and connected == sorted(grid.get_node_ids())
            else:
                no_more = settled and time.time() - t0 >= self.cfg.round_timeout
            if (self.failed and everyone_failed) or no_more:  # a deployment short of nodes too: it waited forever
                raise FederationError(self._too_few(len(healthy), len(connected), sim))
            if len(connected) != last:
                log.info("waiting for nodes: %d connected, %d healthy, %d needed", len(connected), len(healthy), need)
                last = len(connected)
            time.sleep(1.0)

    def _too_few(self, healthy: int, connected: int, sim: bool = True) -> str:
        need = self.cfg.min_nodes
        if not self.failed and sim:
            return (
                f"the simulation has {connected} node(s), {need} needed (min-nodes): lower min-nodes "
                "or raise the federation's num-supernodes"
            )
        if not self.failed:
            return (
                f"{connected} SuperNode(s) connected within round-timeout ({self.cfg.round_timeout:g} s), {need} "
                "needed (min-nodes): start the missing SuperNodes before the run, raise round-timeout to wait "
                "longer for them, or lower min-nodes"
            )
        reasons: dict[str, list[str]] = {}
        for n, r in self.failed.items():
            reasons.setdefault(r, []).append(str(n))
        detail = "\n".join(
            f"  {len(ids)} node(s) ({', '.join(ids[:4])}{'...' if len(ids) > 4 else ''}): {r}"
            for r, ids in reasons.items()
        )
        return f"only {healthy} healthy node(s), {need} needed (min-nodes); excluded nodes:\n{detail}"

    def refresh(self, grid: Grid) -> set[int]:
        """Handshake the nodes that connected since the last call; the connected ids. While fewer
        than ``min-nodes`` healthy nodes are connected, wait up to round-timeout for them: a
        SuperNode whose heartbeat came late (a busy machine) is marked offline for a moment,
        and a restarted one needs time to reconnect. A simulation's nodes never come back later:
        no wait there."""
        t0, warned = time.time(), False
        while True:
            connected = set(grid.get_node_ids())
            self.handshake(grid, connected)
            healthy = sum(n in self.nodes for n in connected)
            if healthy >= self.cfg.min_nodes or simulated_grid(grid) or time.time() - t0 >= self.cfg.round_timeout:
                self.connected = connected
                return connected
            if not warned:
                log.warning(
                    "%d healthy node(s) connected, %d needed (min-nodes): waiting up to %.0f s for the others",
                    healthy,
                    self.cfg.min_nodes,
                    self.cfg.round_timeout,
                )
                warned = True
            time.sleep(1.0)

    def choose(self, connected: set[int], server_round: int, fraction: float, stream: ServerStream) -> list[NodeInfo]:
        """Seeded choice of ``fraction`` of the healthy connected nodes, ordered by name."""
        pool = sorted((n for i, n in self.nodes.items() if i in connected), key=lambda n: n.name)
        if len(pool) < self.cfg.min_nodes:
            gone = sorted(n.name for i, n in self.nodes.items() if i not in connected)
            raise FederationError(
                f"round {server_round}: only {len(pool)} healthy node(s) still connected, fewer than min-nodes = "
                f"{self.cfg.min_nodes} after waiting round-timeout = {self.cfg.round_timeout:.0f} s"
                + (f" (disconnected: {', '.join(gone[:8])})" if gone else "")
                + "; restart the missing SuperNodes, or lower min-nodes to let the run go on with fewer"
            )
        k = min(len(pool), max(1, math.ceil(fraction * len(pool))))
        rng = numpy_rng(server_key(self.cfg.seed, server_round, stream))
        chosen = rng.choice(len(pool), size=k, replace=False)
        return [pool[i] for i in sorted(chosen)]

    def noise_sources(self) -> dict[str, str]:
        """Where each known node draws its noise ('os' or 'seeded'), as its handshake said."""
        return {n.name: n.noise_source for n in self.nodes.values()}

    def table(self) -> tuple[list[dict], dict[str, str]]:
        """(nodes, excluded) as results.json records them."""
        nodes = [vars(n) | {"node_id": str(n.node_id)} for n in sorted(self.nodes.values(), key=lambda n: n.name)]
        return nodes, {str(k): v for k, v in self.failed.items()}
