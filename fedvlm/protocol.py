"""The messages between the ServerApp and the ClientApps, each key written once.

Three exchanges (``docs/architecture.md`` has the table):

- handshake: the server's QUERY carries round 0; the node answers a ``HelloReport`` (who it
  is, its data sizes, its backbone's fingerprint) before any training;
- train: a ``TrainInstruction`` (the round, the tensors the server expects back, and the
  server's plan for this node: local steps, batch size, the record count the plan assumed, the
  local-DP noise) plus the arrays; the client executes the plan, never recomputes it, and
  refuses one its data or its own privacy check cannot honour; the reply holds the shared
  tensors and metrics;
- evaluate: an ``EvaluateInstruction`` (the round; whether it is the last one, when nodes
  publish their personalised prompts) plus the arrays; the reply holds metrics only.

A round's evaluation travels with the next round's train messages (``server_app.loop``): a node
sampled for both gets one train message that also carries the evaluation (``EVALUATE_CONFIG``,
and ``EVALUATE_ARRAYS`` where its arrays differ from the training's). The node evaluates first,
on the state it would have evaluated in a message of its own, then trains; its reply carries the
evaluation's metrics in a record of their own (``EVALUATION``). Where one part fails, the other's
answer still goes back, and the failed part's error in ``FAILED``: a node that refuses to train
(its own epsilon limit reached) still reports its evaluations. One message instead of two per
node and round: on a real deployment each exchange costs a round trip through the SuperLink.

Replies are typed too: a client returns a ``TrainReply`` or an ``EvaluateReply``, the send guard
turns it into records (``to_records``), and the server's checks turn a reply message back into
one (``strategies.validation``, which reads every tensor's header before decoding it). The
tensors' names are in ``fedvlm.tensor_names``, the metrics' in ``fedvlm.metrics``.

Both name the run folder (``run-dir``): a simulated node keeps its private state and publishes
under it; a deployed node keys its own state directory by the folder's name
(``client_app.state``), so that a resumed run finds the state of the run it continues.

Every field travels in the message's ``config`` record (``to_config`` / ``from_config``); a
missing key reads as the field's default, so a client refuses what it needs and lacks
(``privacy.planner.required_local_sigma``) instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedvlm.metrics import COMPUTE_SECONDS, NUM_EXAMPLES

# A message's records: the tensors, the instruction, the figures, a handshake's words.
ARRAYS_RECORD, CONFIG_RECORD, METRICS_RECORD, INFO_RECORD = "arrays", "config", "metrics", "info"
# The config-record keys: the one place they are spelled.
SERVER_ROUND = "server-round"
REPLY_KEYS = "reply-keys"
LOCAL_SIGMA = "dp.local-sigma"
LOCAL_STEPS = "plan.local-steps"
BATCH_SIZE = "plan.batch-size"
NUM_TRAIN = "plan.num-train"
FINAL_ROUND = "final-round"
PUBLISH_DIR = "publish-dir"  # a node config key (client_app.publishing)
NODE_WORKER = "node-worker"  # a node config key: the warm worker's socket path (client_app.worker)
# node config keys read where torch must not be loaded (client_app.secure_aggregation's later stages)
PARTITION_ID, NUM_PARTITIONS = "partition-id", "num-partitions"  # a partition of the run's dataset
REQUIRE_SECURE = "require-secure-aggregation"  # true: training results leave only inside a masked sum
SECURE_MIN_CLIENTS = "secure-aggregation-min-clients"  # the fewest survivors the node helps unmask
SECURE_ROSTER = "secure-aggregation-roster"  # the federation's roster.json the node pins
SECURE_IDENTITY = "secure-aggregation-identity"  # its organisation's identity key
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")  # how a node config's bool reads
RUN_DIR = "run-dir"
# the how-many-th time the server sends this message (server_app.exchange asks a late one again
# once): Flower names a message by its content, so a copy must differ; the node ignores it
ATTEMPT = "attempt"
# The records of a train message that carries the previous round's evaluation, and of its reply.
EVALUATE_CONFIG = "evaluate-config"  # the evaluation's instruction (an ``EvaluateInstruction``)
EVALUATE_ARRAYS = "evaluate-arrays"  # its arrays, where they differ from the train message's
EVALUATION = "evaluation"  # in the reply: the evaluation's metrics
# in the reply: the part of a train message that carried an evaluation which failed ("train" or
# "evaluation" -> the error), so that one part's failure does not take the other's reply with it
FAILED = "failed"

# Secure aggregation (``fedvlm.secagg``, ``secagg.stages``): the record every stage's message and
# reply carries, and its keys. Node ids travel as text (Flower's are unsigned 64-bit).
SECURE_SUM = "secure-sum"
SECAGG_STAGE = "secagg.stage"
SECAGG_ROUND = "secagg.round"  # the plan's server round
SECAGG_PARTICIPANTS = "secagg.participants"  # every node the plan was sent to (U0)
SECAGG_DEGREE = "secagg.degree"  # the configured neighbours per node (0: every other)
SECAGG_THRESHOLD = "secagg.threshold"
SECAGG_BITS = "secagg.bits"
SECAGG_NAMES = "secagg.names"  # the summed tensors, in the vector's order
SECAGG_SIZES = "secagg.sizes"  # their sizes
SECAGG_WEIGHTED = "secagg.weighted"  # each update weighted by the node's examples (else by one)
SECAGG_GAMMA = "secagg.gamma"  # the quantisation step
SECAGG_NORM_BOUND = "secagg.norm-bound"  # the bound the node projects its update onto
SECAGG_CLIENT_SIGMA = "secagg.client-sigma"  # each node's discrete Gaussian, in steps (0: none)
SECAGG_N_MIN = "secagg.n-min"  # the fewest survivors the noise is planned for
SECAGG_ROSTER = "secagg.roster"  # the digest of the roster the server relays for
SECAGG_NODES = "secagg.nodes"  # the nodes the lists below are about, in their order
SECAGG_ENCRYPTION_KEYS = "secagg.encryption-keys"
SECAGG_MASK_KEYS = "secagg.mask-keys"
SECAGG_IDENTITY_KEYS = "secagg.identity-keys"  # each advertiser's member key (secagg.roster)
SECAGG_SIGNATURES = "secagg.signatures"  # of adverts (shares stage) or of the survivor story (unmask)
SECAGG_COMMITMENT = "secagg.commitment"
SECAGG_CIPHERTEXTS = "secagg.ciphertexts"
SECAGG_DEALERS = "secagg.dealers"  # every node whose shares the server routed (U2)
SECAGG_COMPLAINTS = "secagg.complaints"
SECAGG_SURVIVORS = "secagg.survivors"  # every node whose masked vector is in the sum (U3)
SECAGG_SEED_SHARES = "secagg.seed-shares"
SECAGG_KEY_SHARES = "secagg.key-shares"
SECAGG_KEY_OWNERS = "secagg.key-owners"  # the dropped nodes the key shares are of
SECAGG_PAIR_SEEDS = "secagg.pair-seeds"  # a node's pairwise mask seeds with neighbours that never dealt
SECAGG_PAIR_OWNERS = "secagg.pair-owners"  # those neighbours, in the seeds' order
# a node's keys for its next secure round, made before that round's plan: its encryption key, mask key,
# identity key and signature (secagg.node.Prekey), in a train reply
SECAGG_PREKEY = "secagg.prekey"
SECAGG_MASKED = "secagg.masked"  # the masked vector, in the reply's arrays record


def _names(text) -> tuple[str, ...]:
    return tuple(k for k in str(text or "").split(",") if k)


@dataclass(frozen=True)
class TrainInstruction:
    server_round: int
    reply_keys: tuple[str, ...] = ()  # the tensors the server expects back, sorted
    local_steps: int = 0  # local steps this round (0: none planned; the client refuses)
    batch_size: int = 0  # the configured batch size B (expected batch: min(B, num_train))
    num_train: int = 0  # the training records the plan assumed (the node's handshake)
    local_sigma: float | None = None  # std of the local-DP noise the server planned; None: none sent
    run_dir: str = ""  # the server's run folder

    def to_config(self) -> dict:
        out = {
            SERVER_ROUND: self.server_round,
            REPLY_KEYS: ",".join(self.reply_keys),
            LOCAL_STEPS: self.local_steps,
            BATCH_SIZE: self.batch_size,
            NUM_TRAIN: self.num_train,
            RUN_DIR: self.run_dir,
        }
        if self.local_sigma is not None:
            out[LOCAL_SIGMA] = float(self.local_sigma)
        return out

    @classmethod
    def from_config(cls, config: Mapping) -> TrainInstruction:
        sigma = config.get(LOCAL_SIGMA)
        return cls(
            int(config.get(SERVER_ROUND, 0)),
            _names(config.get(REPLY_KEYS)),
            int(config.get(LOCAL_STEPS, 0)),
            int(config.get(BATCH_SIZE, 0)),
            int(config.get(NUM_TRAIN, 0)),
            None if sigma is None else float(sigma),
            str(config.get(RUN_DIR, "")),
        )


@dataclass(frozen=True)
class EvaluateInstruction:
    server_round: int
    final_round: bool = False  # the last evaluation: clients publish their personalised prompts
    run_dir: str = ""  # the server's run folder

    def to_config(self) -> dict:
        return {SERVER_ROUND: self.server_round, FINAL_ROUND: self.final_round, RUN_DIR: self.run_dir}

    @classmethod
    def from_config(cls, config: Mapping) -> EvaluateInstruction:
        return cls(int(config.get(SERVER_ROUND, 0)), bool(config.get(FINAL_ROUND, False)), str(config.get(RUN_DIR, "")))


# The handshake's fields: its words travel in the reply's info record, its numbers in its metrics
# record. Number fields -> (key, the least value a node may report).
HELLO_NUMBERS = {
    "partition_id": ("partition-id", -1),  # -1: a node with its own data folder
    "num_train": ("num-train", 1),
    "num_test": ("num-test", 0),
    "num_neighbor": ("num-neighbor", 0),
    "num_novel": ("num-novel", 0),
    "num_classes": ("num-classes", 1),
    "num_partitions": ("num-partitions", 0),
}
# word fields -> key; the first two every node must state
HELLO_WORDS = {
    "name": "name",
    "backbone": "backbone",
    "noise_source": "noise-source",
    "dataset": "dataset",
    "classes": "classes",
    "device": "device",
    "class_list": "class-list",
    "source_weights": "source-weights",
    "compute": "compute",
}


@dataclass(frozen=True)
class HelloReport:
    """A node's answer to the handshake (``HELLO_NUMBERS``, ``HELLO_WORDS``)."""

    name: str
    partition_id: int
    num_train: int
    num_test: int
    num_neighbor: int
    num_classes: int
    backbone: str  # fingerprint of the loaded weights; every node must match the server's
    noise_source: str  # where the node's DP noise comes from (privacy.mechanisms.NOISE_SOURCES)
    dataset: str = ""  # the identity of its training data
    classes: str = ""  # the class ids its training data holds, comma-separated
    device: str = ""  # where it computes
    class_list: str = ""  # digest of its class names in order: label i must mean one class on every node
    source_weights: str = ""  # reprogramming: the source model's weights
    num_partitions: int = 0  # a partition node's num-partitions (0: its own data): all must agree
    num_novel: int = 0  # its test records of novel classes (class-split base-to-novel)
    compute: str = ""  # the threads and niceness its process trains with (a bench's reader needs them)

    def to_records(self) -> tuple[dict, dict]:
        """(info, metrics): the two records of the reply; an empty word is left out."""
        info = {key: getattr(self, f) for f, key in HELLO_WORDS.items() if getattr(self, f) != ""}
        metrics = {key: getattr(self, f) for f, (key, _) in HELLO_NUMBERS.items()}
        return info, metrics

    @classmethod
    def from_records(cls, info: Mapping, metrics: Mapping) -> HelloReport:
        fields: dict[str, Any] = {f: str(info.get(key, "")) for f, key in HELLO_WORDS.items()}
        fields.update({f: int(metrics[key]) for f, (key, _) in HELLO_NUMBERS.items()})
        return cls(**fields)


Figures = Mapping[str, float | int]


class _ReplyFigures:
    """What every reply's metrics say that the server reads."""

    metrics: Figures

    @property
    def num_examples(self) -> int:
        return int(self.metrics.get(NUM_EXAMPLES, 0))

    @property
    def compute_seconds(self) -> float:
        return float(self.metrics.get(COMPUTE_SECONDS, 0.0))


@dataclass(frozen=True)
class TrainReply(_ReplyFigures):
    """A node's answer to a train message: the shared tensors the server asked for (torch tensors
    on the node, NumPy arrays once the server has checked and decoded them) and its metrics, with
    ``num-examples`` (its weight in the aggregate)."""

    arrays: Mapping[str, Any]
    metrics: Figures

    def with_metrics(self, more: Figures) -> TrainReply:
        return TrainReply(self.arrays, {**self.metrics, **more})

    def to_records(self) -> tuple[dict, dict]:
        """(arrays, metrics): the reply's two records."""
        return dict(self.arrays), dict(self.metrics)

    @classmethod
    def from_records(cls, arrays: Mapping[str, Any], metrics: Mapping) -> TrainReply:
        return cls(dict(arrays), dict(metrics))


@dataclass(frozen=True)
class EvaluateReply(_ReplyFigures):
    """A node's answer to an evaluate message: metrics only (``num-examples``: its test records)."""

    metrics: Figures

    @property
    def arrays(self) -> Mapping[str, Any]:
        return {}  # nothing leaves a node when it evaluates

    def with_metrics(self, more: Figures) -> EvaluateReply:
        return EvaluateReply({**self.metrics, **more})

    def to_records(self) -> tuple[dict, dict]:
        return {}, dict(self.metrics)

    @classmethod
    def from_records(cls, metrics: Mapping) -> EvaluateReply:
        return cls(dict(metrics))
