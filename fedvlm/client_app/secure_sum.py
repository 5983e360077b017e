"""A node's first stage of a secure round (``fedvlm.secagg``): its update leaves only inside a
masked sum. The later stages, and what the node decides for itself, are ``client_app.secure_stages``.

Stage ``keys`` is the train message: the node trains as in any round (``client_app.node_round``),
the send guard checks the tensors it would have sent (``send_guard.check_outgoing``), and the
node encodes them into its vector (``secagg.summand``: its own clip, its noise share) and keeps
it, with its round's secrets, in memory (``client_app.state.SECURE_ROUND``). Its reply carries
the training's figures and two public keys. Stages ``shares``, ``masked`` and ``unmask`` then run
on what it kept (``secagg.node.NodeRound``, which makes the protocol's checks); the masked vector
is the one tensor that leaves (``send_guard.secure_reply``).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedvlm.client_app.privacy_floor import local_release
from fedvlm.client_app.secure_stages import MIN_CLIENTS, ROUND, VECTOR, min_clients
from fedvlm.client_app.send_guard import Guarded, check_outgoing, secure_reply
from fedvlm.client_app.state import clear_secure, save_secure
from fedvlm.privacy.accounting import GaussianReleases, Releases, ZCDpReleases, epsilon_spent
from fedvlm.privacy.distributed import Uniforms
from fedvlm.privacy.ledger import valid_sensitivity
from fedvlm.privacy.mechanisms import sampling_rng
from fedvlm.privacy.planner import ClientShape, NoiseRefused
from fedvlm.protocol import ARRAYS_RECORD, CONFIG_RECORD, SECURE_SUM, EvaluateReply, TrainInstruction
from fedvlm.runconfig import RunConfig
from fedvlm.secagg import stages
from fedvlm.secagg.node import NodeRound, SecAggRefused
from fedvlm.secagg.summand import Summand
from fedvlm.utils.rng import NodeStream, node_key


def first_stage(
    msg: Message,
    context: Context,
    cfg: RunConfig,
    randomness: Uniforms,
    part: Guarded,
    evaluation: EvaluateReply | Exception | None,
) -> Message:
    """Stage ``keys``: the trained reply ``part`` encoded (with ``randomness``, the node's noise
    source's: ``share_randomness``), kept, and answered with public keys."""
    plan = stages.SumPlan.from_config(msg.content[SECURE_SUM])
    floor = min_clients(context.node_config)
    if plan.threshold < floor:
        raise SecAggRefused(
            f"the round's threshold {plan.threshold} lets the server unmask a sum of {plan.threshold} survivors; this "
            f"node's {MIN_CLIENTS} is {floor}"
        )
    if plan.client_sigma > 0 and plan.n_min > plan.threshold:
        raise SecAggRefused(
            f"the round's noise is planned for {plan.n_min} survivors, more than the threshold {plan.threshold} the "
            "protocol guarantees: a sum of fewer would carry less noise than planned"
        )
    config = msg.content[CONFIG_RECORD]
    assert isinstance(config, ConfigRecord)  # the server sends one
    instruction = TrainInstruction.from_config(config)
    check_share(cfg, instruction, plan)
    reply = part.reply
    check_outgoing(reply.arrays, part.allowed, part.private, part.requested)  # what the vector encodes may leave
    record = msg.content[ARRAYS_RECORD]
    assert isinstance(record, ArrayRecord)  # the server sends its tensors as one
    sent = {k: v.numpy() for k, v in record.items()}
    update = {k: v.detach().cpu().double().numpy() - sent.get(k, 0.0) for k, v in reply.arrays.items()}
    weight = reply.num_examples if plan.weighted else 1
    vector = Summand(plan).encode(update, weight, randomness)
    secure, advert = NodeRound.start(
        context.node_id, instruction.server_round, plan.threshold, list(plan.neighbours), plan.bits
    )
    clear_secure(context.state)  # a round left unfinished is over: its secrets go
    save_secure(context.state, {ROUND: secure.to_bytes(), VECTOR: vector.tobytes()})
    return secure_reply(msg, reply.metrics, stages.keys_reply(*advert), evaluation=evaluation)


def check_share(cfg: RunConfig, instruction: TrainInstruction, plan: stages.SumPlan) -> None:
    """The node's own check of its noise share, before it encodes anything (the global noise's
    guarantee must not rest on the server's word, as the local noise's does not,
    ``privacy.planner.required_local_sigma``): with the run's global mechanism, the share the plan
    asks for, summed over the ``n_min`` survivors the node will insist on, and composed with the
    node's local releases over every round, must keep this node's records within the epsilon the
    run promises (``privacy.max-epsilon``, else ``privacy.epsilon``)."""
    settings = cfg.privacy
    if not (settings.enabled and cfg.spec.global_dp):
        return
    if plan.client_sigma <= 0:
        raise NoiseRefused("the run has a global mechanism and the round's secure-sum plan adds no noise")
    noise = Summand(plan).noise
    assert noise is not None  # client_sigma > 0
    shape = ClientShape(instruction.num_train, instruction.batch_size, instruction.local_steps)
    rho, xi = noise.zcdp(valid_sensitivity(settings, settings.clip / shape.expected_batch, 2 * settings.clip))
    releases: list[Releases] = [ZCDpReleases(rho, xi, cfg.num_server_rounds)]
    local = local_release(cfg, shape, instruction.local_sigma)
    if local is not None:
        one = local[0]
        releases.append(GaussianReleases(one.noise_multiplier, one.count * cfg.num_server_rounds, one.sampling_rate))
    promise = settings.max_epsilon or (0.0 if settings.fixed_noise else settings.epsilon)
    spent = epsilon_spent(releases, settings.delta, settings.accountant)
    if promise and spent > promise * (1 + 1e-6):
        raise NoiseRefused(
            f"the round's noise share (sigma {plan.client_sigma:.4g} steps of {plan.gamma:.4g}, for {plan.n_min} "
            f"survivors) would let this node's records spend epsilon = {spent:.4g} over the run, more than "
            f"the {promise:g} it promises: refusing to train"
        )


def share_randomness(cfg: RunConfig, noise_source: str, node_seed: int, server_round: int) -> Uniforms:
    """The randomness of the node's rounding and noise share: its noise source's."""
    if noise_source == "os":
        return Uniforms(None)
    return Uniforms(sampling_rng(noise_source, node_key(cfg.seed, node_seed, NodeStream.SECURE_SUM, server_round)))
