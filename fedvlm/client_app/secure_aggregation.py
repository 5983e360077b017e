"""Secure aggregation on the node (``fedvlm.secagg``), as one layer around the node's handlers, the
way Flower's ``secaggplus_mod`` wraps its ClientApp: the method's handlers never know whether a
round is secure. ``secure_aggregation(handler)`` is that layer; ``client_app.app`` puts it around
the handlers of the ClientApp's own process, ``client_app.worker`` around a warm worker's.

What the node decides for itself (node config), checked on every message before it trains:
- ``require-secure-aggregation = true``: a run without it is refused at the handshake, and a
  train message without the round's secure-sum plan is refused before training, whatever the
  run config says (a run that enables secure aggregation gets the same refusal): the update
  leaves the node only inside a masked sum;
- ``secure-aggregation-min-clients = N``: the node helps unmask only a sum of at least N
  survivors, and refuses a round whose threshold would let the server unmask fewer;
- ``secure-aggregation-roster`` / ``secure-aggregation-identity``: the federation's roster this
  node pins and its member's identity key (``secagg.roster``). A deployed node without them
  refuses every secure round; a simulated node builds the simulation's roster.

The stages (``secagg.stages``):
- ``keys`` is the train message. Before any training, the node checks the plan (``NodeRound.start``:
  threshold, roster, participants) and its own noise share (``check_share``); the handlers then
  train as in any round and hand back the reply the send guard built (``send_guard``: the
  tensors passed ``check_outgoing``); this layer encodes the update into the node's vector
  (``secagg.summand``: projected onto the plan's bound, noised and self-checked) and keeps it
  with the round's secrets, in memory only (``client_app.state.SECURE_ROUND``). The reply
  carries the training's figures and the node's signed advert, no tensor.
- ``shares``, ``consistency`` and ``unmask`` run on what the node kept (``secagg.node.NodeRound``
  makes the protocol's checks), need neither the model nor torch, and so start fast in a ClientApp
  process of their own. The masked vector, sent with the shares (with the train reply where the
  round was keyed a round ahead), is the one tensor that leaves (``send_guard.secure_reply``).

A message asked again (``server_app.post``) gets the answer the node gave the
first copy, if it asks the same; one that asks something else is judged afresh by
``NodeRound``, which refuses what contradicts what the node already did (a second story).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedvlm.client_app.send_guard import secure_reply
from fedvlm.client_app.state import (
    SECURE_KEYED,
    SECURE_ROUND,
    clear_secure,
    load_meta,
    load_secure,
    save_meta,
    save_secure,
)
from fedvlm.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    EVALUATION,
    FAILED,
    METRICS_RECORD,
    NUM_PARTITIONS,
    PARTITION_ID,
    REQUIRE_SECURE,
    SECURE_IDENTITY,
    SECURE_MIN_CLIENTS,
    SECURE_ROSTER,
    SECURE_SUM,
    TRUE_WORDS,
    TrainInstruction,
)
from fedvlm.runconfig import ConfigError
from fedvlm.secagg import stages
from fedvlm.secagg.masks import wire_dtype
from fedvlm.secagg.node import NodeRound, Prekey, SecAggRefused
from fedvlm.secagg.roster import Identity, Roster, RosterError
from fedvlm.secagg.stages import Advert
from fedvlm.spec import spec_of

if TYPE_CHECKING:
    from fedvlm.privacy.distributed import Uniforms
    from fedvlm.runconfig import RunConfig

Handler = Callable[[Message, Context], Message]

ENABLED = "secure-aggregation.enabled"  # the run config's key
# what the node keeps of its secure round: its secrets, its encoded vector, the masked vector it
# sent, and (per stage) a digest of the request it answered
ROUND, VECTOR, MASKED, ASKED = "round", "vector", "masked", "asked"
PREKEY = f"{SECURE_ROUND}-prekey"  # the node's keys for its next round (secagg.node.Prekey), in memory only
PLAN = "plan"  # the digest of the plan the node keyed its last round under (``SECURE_KEYED``)
CARRIED = (EVALUATION, FAILED)  # a train reply's records a keys reply carries back as they were


def required(node_config: Mapping) -> bool:
    return str(node_config.get(REQUIRE_SECURE, "")).strip().lower() in TRUE_WORDS


def min_clients(node_config: Mapping) -> int:
    return int(node_config.get(SECURE_MIN_CLIENTS, 0) or 0)


def secure_run(context: Context) -> bool:
    """Whether this node's training results may leave it only inside secure aggregation."""
    return required(context.node_config) or context.run_config.get(ENABLED) is True


def member(context: Context) -> tuple[Roster, Identity]:
    """The roster this node pins and its member's identity key: from its node config, or, for a
    simulated node, the simulation's (``Roster.simulated``, from the run's seed)."""
    from fedvlm.utils.runtime import simulated

    config = context.node_config
    roster_path, identity_path = config.get(SECURE_ROSTER), config.get(SECURE_IDENTITY)
    if roster_path or identity_path:
        if not (roster_path and identity_path):
            raise ConfigError(f"node config names only one of {SECURE_ROSTER} and {SECURE_IDENTITY}: give both")
        try:
            return Roster.load(Path(str(roster_path))), Identity.load(Path(str(identity_path)))
        except RosterError as why:
            raise ConfigError(str(why)) from None
    partition, members = config.get(PARTITION_ID), config.get(NUM_PARTITIONS)
    if simulated() and partition is not None and members is not None:
        seed = int(str(context.run_config.get("seed", 0)))
        return Roster.simulated(seed, int(str(members))), Identity.simulated(seed, int(str(partition)))
    raise ConfigError(
        f"secure aggregation needs this node's roster and identity: start its SuperNode with --node-config "
        f"\"{SECURE_ROSTER}='/abs/roster.json' {SECURE_IDENTITY}='/abs/<member>.identity'\" (made by python -m "
        "fedvlm.deploy.credentials; docs/deployment.md)"
    )


def hello_check(context: Context) -> None:
    """At the handshake: a node that requires secure aggregation refuses a run without it, and a
    node in a secure run must hold its roster and identity."""
    if required(context.node_config) and context.run_config.get(ENABLED) is not True:
        raise ConfigError(
            f"this node requires secure aggregation ({REQUIRE_SECURE} = true in its node config) and the run does not "
            "use it: set secure-aggregation.enabled = true in the run config"
        )
    if secure_run(context):
        member(context)


def secure_aggregation(inner: Handler) -> Handler:
    """``inner`` (the node's handlers) inside secure aggregation (the module docstring)."""

    def handle(msg: Message, context: Context) -> Message:
        kind = msg.metadata.message_type
        if kind == MessageType.QUERY:
            hello_check(context)
            return inner(msg, context)
        if kind != MessageType.TRAIN:
            return inner(msg, context)
        if SECURE_SUM not in msg.content:
            if secure_run(context):
                raise SecAggRefused(
                    "this node sends its training results only inside secure aggregation (its node config or the "
                    "run requires it), and this train message carries no secure-sum plan: refused before training"
                )
            return inner(msg, context)
        stage = stages.stage_of(msg.content[SECURE_SUM])
        return _first_stage(msg, context, inner) if stage == stages.KEYS else _next_stage(msg, context, stage)

    return handle


def _first_stage(msg: Message, context: Context, inner: Handler) -> Message:
    """Stage ``keys``: the round's terms checked, then the training, its reply encoded and kept,
    and the signed advert sent in its place. Once per round (``keyed``)."""
    from fedvlm.client_app.node_round import NodeMessage  # torch and the models: the training needs them

    plan = stages.SumPlan.from_config(msg.content[SECURE_SUM])
    config = msg.content[CONFIG_RECORD]
    assert isinstance(config, ConfigRecord)  # the server sends one
    instruction = TrainInstruction.from_config(config)
    if plan.server_round != instruction.server_round:
        raise SecAggRefused("the secure-sum plan is for another round than the train message")
    node = NodeMessage.open(context)
    again = keyed(context, plan, node.cfg.num_server_rounds)
    if again is not None:
        return secure_reply(msg, again[0], again[1], masked=again[3], carried=again[2])
    roster, identity = member(context)
    prekeys = stages.read_peer_keys(dict(msg.content[SECURE_SUM]))
    secure, advert, prekey = _key(context, plan, roster, identity, prekeys)
    check_share(node.cfg, instruction, plan)
    save_meta(context.state, {ROUND: plan.server_round, PLAN: plan.digest.hex()}, SECURE_KEYED)
    clear_secure(context.state)  # a round left unfinished is over: its secrets go
    context.state[PREKEY] = ConfigRecord(dict(prekey.to_config()))  # memory only (state.SECURE_ROUND's prefix)
    dealt = secure.share(prekeys, roster) if advert is None else (b"", {})  # U1 checked before any training
    reply = inner(msg, context)
    record = reply.content.get(ARRAYS_RECORD) if not reply.has_error() else None
    if not isinstance(record, ArrayRecord) or not record:
        return reply  # the training failed (an error, or a failed part beside an evaluation): no tensor in it
    sent = msg.content[ARRAYS_RECORD]
    assert isinstance(sent, ArrayRecord)  # the server sends its tensors as one
    metrics = reply.content[METRICS_RECORD]
    assert isinstance(metrics, MetricRecord)  # the send guard writes one
    from fedvlm.protocol import TrainReply
    from fedvlm.secagg.summand import Summand

    figures = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    update = {k: v.numpy().astype(np.float64) - (sent[k].numpy() if k in sent else 0.0) for k, v in record.items()}
    randomness = share_randomness(node.cfg, node.node.noise_source, node.node.seed, plan.server_round)
    weight = int(TrainReply.from_records({}, figures).num_examples) if plan.weighted else 1
    vector = Summand(plan).encode(update, weight, randomness)
    held = {VECTOR: vector.tobytes()}
    if advert is None:  # keyed a round ahead: the masked vector goes with the shares, in this reply
        held[MASKED] = secure.mask(vector).astype(wire_dtype(plan.bits)).tobytes()
    answer = stages.keys_reply(advert) if advert is not None else stages.prekeyed_reply(*dealt)
    answer.update(stages.prekey_fields(prekey.advert))
    save_secure(context.state, {ROUND: secure.to_bytes(), **held})
    save_secure(context.state, answer, f"/{stages.KEYS}")
    save_secure(context.state, figures, f"/{stages.KEYS}/{METRICS_RECORD}")
    for key in CARRIED:
        if key in reply.content:
            context.state[f"{SECURE_ROUND}/{stages.KEYS}/{key}"] = reply.content[key]
    return secure_reply(msg, figures, answer, masked=_masked(held, plan.bits), carried=reply.content)


def _key(
    context: Context, plan: stages.SumPlan, roster: Roster, identity: Identity, prekeys: Mapping[int, Advert]
) -> tuple[NodeRound, Advert | None, Prekey]:
    """The node's round under ``plan``: keyed with its prekey where the plan lists every
    participant's (``prekeys``; no advert to send), else with fresh keys and their advert; and the
    prekey its reply sends for its next round. The held prekey leaves the node's state before
    anything else happens, so that it keys one session at most, whatever the server asks next."""
    held = context.state.get(PREKEY)
    if held is not None:
        del context.state[PREKEY]
    prekey = Prekey.from_config(dict(held)) if isinstance(held, ConfigRecord) else None
    floor = min_clients(context.node_config)
    if not prekeys:
        secure, advert = NodeRound.start(context.node_id, plan, roster, identity, floor)
        return secure, advert, prekey or Prekey.new(context.node_id, identity)
    if prekey is None or prekeys.get(context.node_id) != prekey.advert:
        raise SecAggRefused(
            "the round's plan lists keys for this node that it does not hold unused (made for another run, used "
            "already, or never its own): a prekey keys one session at most"
        )
    secure = NodeRound.from_prekey(context.node_id, plan, roster, identity, prekey, floor)
    return secure, None, Prekey.new(context.node_id, identity)


def keyed(
    context: Context, plan: stages.SumPlan, rounds: int
) -> tuple[dict, dict, RecordDict, np.ndarray | None] | None:
    """Whether this node may key a secure sum of ``plan``'s round: the run's rounds at most, once
    each, in order. The same round under the same plan again (a copy of the message, or the same
    round resumed) gets the node's first answer (None: the node keys it now); anything else is
    refused. A node that trained a round's update into a second session, or an earlier round's,
    would let the server difference two sums into that update (a second session of one round
    draws the same update and, with a seeded source, the same noise share); and a node that keys
    at most ``rounds`` sums makes at most the releases ``check_share`` accounts."""
    if plan.server_round > rounds:
        raise SecAggRefused(
            f"a secure sum for round {plan.server_round} of a run of {rounds} rounds: this node releases at most one "
            "masked update per round of the run (its noise share is checked for that many)"
        )
    last = load_meta(context.state, SECURE_KEYED)
    if not last or plan.server_round > int(last[ROUND]):
        return None
    if plan.server_round < int(last[ROUND]) or last[PLAN] != plan.digest.hex():
        raise SecAggRefused(
            f"this node keyed round {last[ROUND]}'s secure sum already and is asked to key round {plan.server_round} "
            "under "
            + ("another plan" if plan.server_round == int(last[ROUND]) else "an earlier round")
            + ": refused (a second sum of the same update would reveal it)"
        )
    answer = load_secure(context.state, f"/{stages.KEYS}")
    if not answer:
        raise SecAggRefused(
            f"this node keyed round {plan.server_round}'s secure sum already and no longer holds that session (it "
            "restarted, or its training failed): it sits this round out"
        )
    figures = load_secure(context.state, f"/{stages.KEYS}/{METRICS_RECORD}")
    carried = RecordDict()
    for key in CARRIED:
        found = context.state.get(f"{SECURE_ROUND}/{stages.KEYS}/{key}")
        if found is not None:
            carried[key] = found
    return figures, answer, carried, _masked(load_secure(context.state), plan.bits)


def check_share(cfg: RunConfig, instruction: TrainInstruction, plan: stages.SumPlan) -> None:
    """The node's own check of its noise share, before it trains (the global noise's guarantee
    must not rest on the server's word, as the local noise's does not,
    ``privacy.planner.required_local_sigma``): the share the plan asks for, summed over the
    ``n_min`` survivors the node insists on (its threshold check), composed with the node's local
    mechanism over every round exactly as the ledger composes them
    (``privacy.planner.record_account``), must keep its records within the epsilon the run
    promises (``privacy.max-epsilon``, else ``privacy.epsilon``). Every node of the round checks
    the same plan (its digest is in every advert), so the sum carries n_min such shares."""
    from fedvlm.privacy.accounting import epsilon_spent
    from fedvlm.privacy.ledger import valid_sensitivity
    from fedvlm.privacy.planner import ClientShape, NoiseRefused, record_account
    from fedvlm.secagg.summand import Summand

    settings, spec = cfg.privacy, spec_of(cfg)
    if not (settings.enabled and spec.global_dp):
        return
    noise = Summand(plan).noise
    if noise is None:
        raise NoiseRefused("the run has a global mechanism and the round's secure-sum plan adds no noise")
    shape = ClientShape(instruction.num_train, instruction.batch_size, instruction.local_steps)
    zcdp = noise.zcdp(valid_sensitivity(settings, settings.clip / shape.expected_batch, 2 * settings.clip))
    local = spec.local_dp(cfg) if spec.local_dp else None
    account = record_account(settings, local, shape, instruction.local_sigma if local else None, zcdp=zcdp)
    spent = epsilon_spent(account.releases(cfg.num_server_rounds), settings.delta, settings.accountant)
    promise = settings.max_epsilon or (0.0 if settings.fixed_noise else settings.epsilon)
    if promise and spent > promise * (1 + 1e-6):
        raise NoiseRefused(
            f"the round's noise share (sigma {plan.client_sigma:.4g} steps of {plan.gamma:.4g}, for {plan.n_min} "
            f"survivors), with this node's local noise, would let its records spend epsilon = {spent:.4g} over the "
            f"run, more than the {promise:g} it promises: refusing to train"
        )


def share_randomness(cfg: RunConfig, noise_source: str, node_seed: int, server_round: int) -> Uniforms:
    """The randomness of the node's rounding and noise share: its noise source's."""
    from fedvlm.privacy.distributed import Uniforms
    from fedvlm.privacy.mechanisms import sampling_rng
    from fedvlm.utils.rng import NodeStream, node_key

    if noise_source == "os":
        return Uniforms(None)
    return Uniforms(sampling_rng(noise_source, node_key(cfg.seed, node_seed, NodeStream.SECURE_SUM, server_round)))


def _next_stage(msg: Message, context: Context, stage: str) -> Message:
    """Stages ``shares``, ``consistency`` and ``unmask``, on what the node kept."""
    config = dict(msg.content[SECURE_SUM])
    held = load_secure(context.state)
    if ROUND not in held:
        raise SecAggRefused("this node holds no secure round in progress (it restarted, or never trained in it)")
    asked = hashlib.sha256(repr(sorted(config.items())).encode()).hexdigest()
    before = load_secure(context.state, f"/{stage}")
    if before.get(ASKED) == asked:  # a copy of a message already answered: the same answer
        return _reply(msg, stage, before, held)
    secure = NodeRound.from_bytes(held[ROUND])
    answer: dict
    if stage == stages.SHARES:
        answer = stages.shares_reply(*secure.share(stages.read_peer_keys(config), member(context)[0]))
        masked = secure.mask(np.frombuffer(held[VECTOR], dtype=np.uint64))
        held[MASKED] = masked.astype(wire_dtype(secure.plan.bits)).tobytes()
    elif stage == stages.CONSISTENCY:
        dealers, survivors, ciphertexts = stages.read_story(config)
        secure.receive(dealers, ciphertexts)
        signature = secure.sign_story(survivors, member(context)[1], min_clients(context.node_config))
        answer = stages.story_signature(signature, secure.complaints)
    else:
        answer = stages.shares_back(*secure.reveal(stages.read_unmask(config)))
    held[ROUND] = secure.to_bytes()
    save_secure(context.state, held)
    save_secure(context.state, {**answer, ASKED: asked}, f"/{stage}")
    return _reply(msg, stage, answer, held)


def _reply(msg: Message, stage: str, answer: dict, held: dict) -> Message:
    masked = _masked(held, NodeRound.from_bytes(held[ROUND]).plan.bits) if stage == stages.SHARES else None
    return secure_reply(msg, {}, {k: v for k, v in answer.items() if k != ASKED}, masked=masked)


def _masked(held: Mapping, bits: int) -> np.ndarray | None:
    """The masked vector the node sent in this round (None: not yet), as it went on the wire."""
    raw = held.get(MASKED)
    return np.frombuffer(raw, dtype=wire_dtype(bits)) if isinstance(raw, bytes) else None
