"""What a method is: the typed entries of the registry (``methods.registry``).

Everything method-specific is a field here, so that no other module needs to ask which
method or family it is running: the strategy and client classes, the rule for which tensors
may leave a client, the local-DP mechanism, what trains (model kind, adapter kind), the
method's config defaults and the rank key its config check reads. This module imports no strategy or client
code, so both sides can type against it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from fedvlm.privacy.planner import ClientShape, LocalDP
from fedvlm.runconfig.schema import RunConfig

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
    node_data: Callable[[Any, dict], Any]  # (run config, node config) -> the node's data
    # (run config, a node's training records) -> its local training per round: batch size and
    # steps. The server plans with it and sends the result; clients never recompute it.
    local_shape: Callable[[RunConfig, int], ClientShape]
    privacy_clip: float = 10.0  # what privacy.clip = 'auto' means
    noise_multiplier: float = 0.0  # what privacy.noise-multiplier = 'auto' means (0: calibrate to epsilon)
    # the combinations the family cannot run (raises ConfigError), on the resolved flat values
    check: Callable[[dict], None] | None = None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: Family
    summary: str
    strategy: type  # the server strategy (a strategies.base.FederatedStrategy)
    client: type[Any]  # the client trainer
    shares: SharedRule = shares_nothing  # which tensors may leave a client
    trains: bool = True
    defaults: dict = field(default_factory=dict)  # what 'auto' means per flat key, for this method
    dp_defaults: dict = field(default_factory=dict)  # ... with privacy on, where it differs
    # the local-DP mechanism its clients run when privacy is on (a function of the run config);
    # None: no DP mechanism
    local_dp: Callable[[RunConfig], LocalDP] | None = None
    model_kind: str = ""  # reprogramming: what trains ('mr', 'ff', 'pf', 'ts'; models.reprogram)
    adapter: str = ""  # VLM methods: the peft adapter ('lora', 'loha')
    rank_key: str = ""  # low-rank prompt methods: the config key of the rank k (checked: k <= M)
    # the method's own config checks on the resolved flat values (raises ConfigError)
    check: Callable[[dict], None] | None = None

    @property
    def supports_dp(self) -> bool:
        return self.local_dp is not None
