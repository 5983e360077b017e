"""What a method is: the typed entries of the registry (``methods.registry``).

Everything method-specific is a field here, so that no other module needs to ask which
method or family it is running: the strategy and client classes, the rule for which tensors
may leave a client, the local-DP mechanism and the server's, what trains (model kind, adapter kind), the
method's config defaults and the rank key its config check reads. This module imports no strategy or client
code, so both sides can type against it without an import cycle.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedvlm.metrics import Metric
from fedvlm.privacy.planner import ClientShape, GlobalDP, LocalDP
from fedvlm.protocol import EvaluateInstruction, EvaluateReply, HelloReport, TrainInstruction, TrainReply
from fedvlm.runconfig.schema import RunConfig
from fedvlm.utils.imports import load

# (run config, names of the tensors the client's model has) -> names that may leave a client.
# The server, the client and the send guard all evaluate this one rule.
SharedRule = Callable[[RunConfig, Collection[str]], frozenset[str]]


def shares_nothing(cfg: RunConfig, names: Collection[str]) -> frozenset[str]:
    return frozenset()


def shares_all(cfg: RunConfig, names: Collection[str]) -> frozenset[str]:
    return frozenset(names)


def shares_only(*fixed: str) -> SharedRule:
    """A fixed set of tensor names, whatever the model holds (e.g. a prompt method's
    ``global_grad``, a gradient that is not itself a model tensor)."""
    return lambda cfg, names: frozenset(fixed)


class NodeClient(Protocol):
    """What the ClientApp's handlers (``client_app.handlers``) call on a method's client: the one
    contract every family's client meets. ``client_app.client.Client`` is the base class that
    implements it (the state every client is built with); the three messages are each family's.
    The ClientApp builds one per message: ``client(run config, the node's data, its private state
    (Flower's Context.state), the round, the audited node's canaries or None)``."""

    def __init__(self, cfg: RunConfig, node: Any, state: Any, server_round: int, canaries: Any = None): ...

    node: Any  # the node's data (client_app.node.NodeData, client_app.vlm_node.VLMNodeData)
    canaries: Any  # the audited node's canaries (privacy.canaries.Canaries), given at construction; else None

    @property
    def tensor_names(self) -> frozenset[str]:
        """The tensors of the node's model the method's sharing rule (``MethodSpec.shares``) chooses from."""
        ...

    @property
    def private(self) -> Mapping[str, Any]:
        """Tensors that must never appear in a reply (the send guard compares bytes)."""
        ...

    def records(self, n_real: int) -> int:
        """The training records the node reports and plans with (the audit's canary slots included)."""
        ...

    def commit(self) -> None:
        """Write what the node keeps into its private state (the handler persists it after)."""
        ...

    def published(self, arrays: dict[str, Any]) -> dict | None:
        """What the node publishes on its own disk at the end of a run, for the state the server
        sent; None: nothing."""
        ...

    @abstractmethod
    def hello(self) -> HelloReport:
        """Who this node is, for the server's handshake."""

    @abstractmethod
    def train(self, arrays: dict[str, Any], instruction: TrainInstruction) -> TrainReply:
        """The plan's local steps on what the server sent: the shared tensors and the metrics."""

    @abstractmethod
    def evaluate(self, arrays: dict[str, Any], instruction: EvaluateInstruction) -> EvaluateReply:
        """This node's figures for the state the server sent: it only evaluates (what the node
        keeps is committed, and its model published, by the handler)."""


@dataclass(frozen=True)
class Family:
    """What the methods of one family share: their data, their defaults (what 'auto' resolves
    to), and how a node loads its data."""

    name: str
    image_text: bool  # image-text data (captions, VQA) rather than image classification
    default_dataset: str
    default_partitioner: str
    dirichlet_alpha: float  # what dirichlet-alpha = 'auto' means (the family's papers' value)
    fraction_train: float  # what fraction-train = 'auto' means
    # 'module:function' of (run config, node config) -> the node's data, imported where a node runs
    node_loader: str
    # (run config, a node's training records) -> its local training per round: batch size and
    # steps. The server plans with it and sends the result; clients never recompute it.
    local_shape: Callable[[RunConfig, int], ClientShape]
    privacy_clip: float = 10.0  # what privacy.clip = 'auto' means
    class_splits: tuple[str, ...] = ("none",)  # the class-split values its evaluation supports
    noise_multiplier: float = 0.0  # what privacy.noise-multiplier = 'auto' means (0: calibrate to epsilon)
    # the combinations the family cannot run (raises ConfigError), on the resolved typed config
    check: Callable[[RunConfig], None] | None = None
    # the figures its clients or strategy report beyond the catalogue's (``fedvlm.metrics``):
    # registered with the method (``methods.registry.register_method``), so that the server's
    # checks accept them and the results, plots and rounds.csv show them
    metrics: tuple[Metric, ...] = ()
    # 'module:function' of (a finished run's folder, shadow federations, online-LiRA reference
    # federations) -> the membership attacks
    # that apply to the family's models, pooled over clients by attack name ({metric: {"value",
    # "ci95"}}, ``experiments.attack_report``); '' where none applies yet (the sweep and the
    # leaderboard say so)
    membership_attack: str = ""
    # 'module:function' of a run folder -> the pooled attacks its attack report holds, or None
    # where it holds none (read only: nothing is attacked; the run's privacy plot shows the best)
    attack_report: str = ""

    @property
    def node_data(self) -> Callable[[Any, dict], Any]:
        """How a node loads its data: (run config, node config) -> the node's data."""
        return load(self.node_loader)

    @property
    def attack(self) -> Callable[[Any, int, int], dict[str, dict]] | None:
        """The family's membership attacks (``membership_attack``), or None."""
        return load(self.membership_attack) if self.membership_attack else None

    @property
    def reported_attacks(self) -> Callable[[Path], dict[str, dict] | None] | None:
        """How a run folder's attack report is read (``attack_report``), or None."""
        return load(self.attack_report) if self.attack_report else None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: Family
    summary: str
    # the server strategy (a strategies.base.FederatedStrategy) and the client class (a
    # client_app.client.Client), each named 'module:Class' and imported only by the side that runs
    # it (``strategy``, ``client``): a node never imports server code, and the table itself sits
    # below both sides
    strategy_path: str
    client_path: str
    shares: SharedRule = shares_nothing  # which tensors may leave a client
    trains: bool = True
    defaults: dict = field(default_factory=dict)  # what 'auto' means per flat key, for this method
    dp_defaults: dict = field(default_factory=dict)  # ... with privacy on, where it differs
    # the local-DP mechanism its clients run when privacy is on (a function of the run config);
    # None: no DP mechanism
    local_dp: Callable[[RunConfig], LocalDP] | None = None
    # the server's mechanism when privacy is on, from the run config and the clients sampled per
    # round (its average's fixed denominator); None: the server adds no noise
    global_dp: Callable[[RunConfig, int], GlobalDP] | None = None
    model_kind: str = ""  # reprogramming: what trains ('mr', 'ff', 'pf', 'ts'; models.reprogram)
    adapter: str = ""  # VLM methods: the peft adapter ('lora', 'loha')
    rank_key: str = ""  # low-rank prompt methods: the config key of the rank k (checked: k <= M)
    # the method's own config checks on the resolved typed config (raises ConfigError)
    check: Callable[[RunConfig], None] | None = None
    # the figures its clients or strategy report beyond the catalogue's (``fedvlm.metrics``):
    # registered with the method (``methods.registry.register_method``), so that the server's
    # checks accept them and the results, plots and rounds.csv show them
    metrics: tuple[Metric, ...] = ()
    # why its server needs each client's upload itself rather than their sum ("": the sum
    # suffices, so secure aggregation applies, ``strategies.secure_sum``)
    individual_uploads: str = ""

    @property
    def strategy(self) -> type:
        """The server strategy class (imported on first use)."""
        return load(self.strategy_path)

    @property
    def client(self) -> type[NodeClient]:
        """The client class (imported on first use)."""
        return load(self.client_path)

    @property
    def supports_dp(self) -> bool:
        return self.local_dp is not None


def spec_of(cfg: RunConfig) -> MethodSpec:
    """The run's method (``RunConfig.spec``), typed. The config holds it opaque because it sits
    below this module; a config carrying anything else is refused here, not read blind."""
    spec = cfg.spec
    if not isinstance(spec, MethodSpec):
        raise TypeError(
            f"this run config carries a {type(spec).__name__} where its method's MethodSpec belongs; "
            "build run configs with fedvlm.methods.validation.validate"
        )
    return spec
