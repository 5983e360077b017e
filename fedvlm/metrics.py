"""Every figure a run reports, declared once: its name, what kind of number it is, who reports it,
how the server turns the nodes' values into the round's figure, and where it shows.

- a node's reply may carry exactly the metrics declared for its message (``TRAIN``,
  ``EVALUATE``), each in its kind's range: the server's checks read this catalogue
  (``strategies.validation.check_metric``), so a figure a client invents, or sends in the wrong
  reply, is left out with the reason rather than recorded;
- the server's round figures (``SERVER``) are the metrics a strategy's hooks return, and the
  nodes' values combined as their ``combine`` says (``round_figures``); the loop refuses a
  figure that is not declared here;
- results.json's summary (``headline``), the progress line (``progress``), the plots (``plot``:
  one PNG per group, its axis from the kind) and the run's ``rounds.csv`` (catalogue order) read
  the same entries.

A new figure is one ``register_metric`` call (this module's own are at its end); a method that
reports one registers it where the method is defined, before a run starts. Names are spelled
only here: clients and strategies use the constants and builders below (a test checks that no
other module writes one as a literal).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

TRAIN, EVALUATE, SERVER = "train", "evaluate", "server"  # who reports a metric


@dataclass(frozen=True)
class Kind:
    """What a kind of number may be, and how it reads."""

    name: str
    lowest: float
    highest: float
    integer: bool = False
    axis: str = ""  # a plot's y-axis label
    unit: str = ""  # a table column's unit, after scaling
    scale: float = 1.0  # shown as value x scale (a proportion as a percentage)
    fmt: str = ".4f"  # how a value is printed (after scaling)

    def show(self, value: float) -> str:
        return f"{value * self.scale:{self.fmt}}{'%' if self.scale == 100.0 else ''}"


COUNT = Kind("count", 0.0, math.inf, integer=True, axis="count", fmt=".0f")
PROPORTION = Kind("proportion", 0.0, 1.0, axis="accuracy (%)", unit="%", scale=100.0, fmt=".2f")
LOSS = Kind("loss", 0.0, 1e4, axis="loss", fmt=".4f")
PERCENT = Kind("percent", 0.0, 100.0, axis="score (0-100)", fmt=".2f")  # BLEU, ROUGE-L, VQA accuracy x100
CIDER = Kind("cider", 0.0, 1000.0, axis="CIDEr (x100)", unit="CIDEr x100", fmt=".2f")
SECONDS = Kind("seconds", 0.0, 1e7, axis="seconds", fmt=".1f")
EPSILON = Kind("epsilon", 0.0, 1e9, axis="epsilon", fmt=".4g")
SIGMA = Kind("sigma", 0.0, math.inf, axis="noise std", fmt=".4g")


@dataclass(frozen=True)
class Combine:
    """How the server makes one round figure of the nodes' values of metric ``of``: their plain
    ``mean`` (as the papers report per-client figures), their spread over nodes (``std``, the
    worst node's ``min``: ``PER_CLIENT``), ``weighted`` mean by the count metric ``weight``
    (the federation's figure for the union of the nodes' records), or the ``harmonic`` mean of
    the round figures ``of`` and ``other`` (CoCoOp's base-to-novel H, of the means, as it reports it)."""

    statistic: str  # 'mean' | 'std' | 'min' | 'weighted' | 'harmonic'
    of: str
    weight: str = ""
    other: str = ""


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    summary: str
    reporters: frozenset[str]  # TRAIN / EVALUATE: the node replies that carry it; SERVER: the round's record
    combine: Combine | None = None  # a round figure made from the nodes' values
    plot: str = ""  # the PNG of the run folder it is drawn in ('' none)
    headline: bool = False  # in results.json's summary: the last round's value and the mean of the last 10
    label: str = ""  # the progress line's words for it ('' not shown there)

    def check(self, value: object) -> str | None:
        """Why ``value`` cannot be this metric (None: it can)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"metric {self.name!r} is {value!r}, expected a finite number"
        kind = self.kind
        if not (kind.lowest <= value <= kind.highest and (isinstance(value, int) or not kind.integer)):
            expected = "a non-negative integer" if kind.integer else f"in [{kind.lowest:g}, {kind.highest:g}]"
            return f"metric {self.name!r} is {value!r}, expected {expected}"
        return None


METRICS: dict[str, Metric] = {}


def register_metric(metric: Metric) -> Metric:
    """Declare ``metric``. A name is declared once: a second, different declaration is refused
    (the same one again, as a re-imported module makes it, is not)."""
    known = METRICS.get(metric.name)
    if known is not None and known != metric:
        raise ValueError(f"metric {metric.name!r} is already declared differently: {known}")
    c = metric.combine
    for of in () if c is None else (c.of, c.other) if c.other else (c.of,):
        if of != metric.name and of not in METRICS:
            raise ValueError(f"metric {metric.name!r} combines {of!r}, which is not declared")
    METRICS[metric.name] = metric
    return metric


def _metric(name: str, kind: Kind, summary: str, *reporters: str, **more) -> str:
    return register_metric(Metric(name, kind, summary, frozenset(reporters), **more)).name


def reply_metric(name: str, message: str) -> Metric | str:
    """The declaration of a metric a node sent in a ``message`` (TRAIN or EVALUATE) reply, or
    why it cannot be one."""
    metric = METRICS.get(name)
    if metric is None:
        return f"metric {name!r} is not one this project's clients report (declare it in fedvlm.metrics)"
    if message not in metric.reporters:
        where = ", ".join(sorted(metric.reporters))
        return f"metric {name!r} is not one a {message} reply carries (it is reported in: {where})"
    return metric


def round_figures(replies: Sequence[Mapping[str, float]], message: str) -> dict[str, float]:
    """The round's figures the catalogue makes from the nodes' ``message`` replies' metrics."""
    out: dict[str, float] = {}
    for metric in METRICS.values():
        c = metric.combine
        if c is None or message not in METRICS[c.of].reporters:
            continue
        values = [r[c.of] for r in replies if c.of in r]
        if not values or c.statistic == "harmonic":
            continue
        if c.statistic == "mean":
            out[metric.name] = float(np.mean(values))
        elif c.statistic == "std":
            out[metric.name] = float(np.std(values))
        elif c.statistic == "min":
            out[metric.name] = float(np.min(values))
        else:
            pairs = [(r[c.of], r.get(c.weight, 0)) for r in replies if c.of in r]
            total = sum(w for _, w in pairs)
            if total > 0:
                out[metric.name] = float(sum(v * w for v, w in pairs) / total)
    for metric in METRICS.values():  # of the figures just made: a harmonic mean of two round means
        c = metric.combine
        if c is not None and c.statistic == "harmonic" and c.of in out and c.other in out:
            a, b = out[c.of], out[c.other]
            out[metric.name] = 2 * a * b / (a + b) if a + b > 0 else 0.0
    return out


# the statistics that describe how a figure varies over the nodes, not the federation's figure
PER_CLIENT = ("std", "min")


def per_client(name: str) -> dict[str, str]:
    """The round figures that spread ``name`` over the nodes, by statistic ({'std': .., 'min': ..})."""
    return {
        m.combine.statistic: m.name
        for m in METRICS.values()
        if m.combine is not None and m.combine.of == name and m.combine.statistic in PER_CLIENT
    }


def undeclared(names: Iterable[str]) -> list[str]:
    return [n for n in names if n not in METRICS]


def _per_client(name: str, kind: Kind) -> tuple[str, str]:
    """The round figures that spread ``name`` (a higher-is-better node figure) over the nodes:
    its std over the nodes and the worst node's, both in results.json's summary."""
    std = _metric(
        f"{name}-std",
        kind,
        f"std over the round's nodes of {name} (ddof 0: all of them)",
        SERVER,
        combine=Combine("std", name),
        headline=True,
    )
    worst = _metric(
        f"{name}-worst", kind, f"the round's worst node's {name}", SERVER, combine=Combine("min", name), headline=True
    )
    return std, worst


# ---- this project's figures -------------------------------------------------------------------
# weights and sizes
NUM_EXAMPLES = _metric(
    "num-examples", COUNT, "a train reply's weight in the aggregate; an evaluation's test records", TRAIN, EVALUATE
)
COMPUTE_SECONDS = _metric("compute-seconds", SECONDS, "the node's time on the message, setup included", TRAIN, EVALUATE)
TRAIN_SECONDS = _metric("train-seconds", SECONDS, "the node's time in its training loop", TRAIN)
STEPS = _metric("local-steps", COUNT, "local steps the node ran this round", TRAIN)
ROUNDS_TRAINED = _metric("rounds-trained", COUNT, "rounds the node had trained before this one", TRAIN)
LOCAL_N = _metric("local-n", COUNT, "test records of the node's own classes", EVALUATE)
NEIGHBOR_N = _metric("neighbor-n", COUNT, "test records of the other nodes' classes", EVALUATE)
NOVEL_N = _metric("novel-n", COUNT, "test records of the held-out novel classes (class-split base-to-novel)", EVALUATE)
OOD_EXAMPLES = _metric("ood-examples", COUNT, "out-of-domain test records the node scored", EVALUATE)

# training
TRAIN_LOSS = _metric(
    "train-loss",
    LOSS,
    "mean training loss of the round's local steps",
    TRAIN,
    combine=Combine("weighted", "train-loss", NUM_EXAMPLES),
    plot="loss.png",
    headline=True,
    label="train loss",
)
TRAIN_LOSS_FIRST = _metric("train-loss-first", LOSS, "the round's first local step's loss", TRAIN)
TRAIN_LOSS_LAST = _metric("train-loss-last", LOSS, "the round's last local step's loss", TRAIN)
TRAIN_ACC = _metric(
    "train-acc",
    PROPORTION,
    "accuracy on the round's training batches",
    TRAIN,
    combine=Combine("weighted", "train-acc", NUM_EXAMPLES),
    plot="accuracy.png",
)
CLIPPED_FRACTION = _metric("dp-clipped-fraction", PROPORTION, "fraction of per-sample gradients DP-SGD clipped", TRAIN)

# evaluation of the image-classification methods: the node's own classes, its neighbours', and,
# under class-split = base-to-novel, the novel classes no node trained on
TEST_SETS = ("local", "neighbor", "novel")
# by test set: the nodes' accuracy, cross-entropy and records; the round's spread and weighted figures
ACC: dict[str, str] = {}
TEST_LOSS: dict[str, str] = {}
TEST_N = {"local": LOCAL_N, "neighbor": NEIGHBOR_N, "novel": NOVEL_N}
ACC_STD: dict[str, str] = {}
ACC_WORST: dict[str, str] = {}
ACC_WEIGHTED: dict[str, str] = {}
LOSS_WEIGHTED: dict[str, str] = {}
_WORDS = ("its own classes", "the other nodes' classes", "the held-out novel classes, among those classes alone")
for _tag, _words in zip(TEST_SETS, _WORDS, strict=True):
    ACC[_tag] = _metric(
        f"{_tag}-acc",
        PROPORTION,
        f"test accuracy on {_words}; the round's figure is the mean over nodes, as the papers report it",
        EVALUATE,
        combine=Combine("mean", f"{_tag}-acc"),
        plot="accuracy.png",
        headline=True,
        label=_tag,
    )
    TEST_LOSS[_tag] = _metric(f"{_tag}-loss", LOSS, f"test cross-entropy on {_words}", EVALUATE)
    ACC_STD[_tag], ACC_WORST[_tag] = _per_client(ACC[_tag], PROPORTION)
    ACC_WEIGHTED[_tag] = _metric(
        f"{_tag}-acc-weighted",
        PROPORTION,
        f"{_tag}-acc over the union of the nodes' test records",
        SERVER,
        combine=Combine("weighted", ACC[_tag], TEST_N[_tag]),
    )
    LOSS_WEIGHTED[_tag] = _metric(
        f"{_tag}-loss-weighted",
        LOSS,
        f"{_tag}-loss over the union of the nodes' test records",
        SERVER,
        combine=Combine("weighted", TEST_LOSS[_tag], TEST_N[_tag]),
        plot="loss.png",
        headline=_tag == "local",
    )

BASE_NOVEL_HM = _metric(
    "base-novel-hm",
    PROPORTION,
    "harmonic mean of local-acc (the node's own, base classes) and novel-acc, CoCoOp's H (class-split base-to-novel)",
    SERVER,
    combine=Combine("harmonic", ACC["local"], other=ACC["novel"]),
    headline=True,
)

# evaluation of the VLM methods: the server's model and each node's own, on the node's test
# records; the server's also out of domain. Scores are x100 (utils.vlm_metrics).
SERVER_MODEL, CLIENT_MODEL = "server", "client"
VLM_MODELS = (SERVER_MODEL, CLIENT_MODEL)
CAPTION_SCORES = ("bleu-1", "bleu-2", "bleu-3", "bleu-4", "rouge-l", "cider")
VQA_SCORES = ("accuracy",)
TASK_LOSS = "loss"
OOD = "server-ood"


def vlm_score(model: str, score: str) -> str:
    """The metric of ``score`` (a caption score, 'accuracy' or 'loss') for ``model`` ('server',
    'client', or ``OOD``: the server's model out of domain)."""
    name = f"{model}-{score}"
    if name not in METRICS:
        raise KeyError(f"no metric {name!r} is declared")
    return name


# the summary's VLM figures (as the papers report them) and the progress line's
_OWN = {"cider", "bleu-4", "rouge-l", "accuracy", TASK_LOSS}
_PLOTTED = {"bleu-4", "rouge-l", "accuracy"}
_HEADLINE = {SERVER_MODEL: _OWN, CLIENT_MODEL: _OWN, OOD: {"cider", "bleu-4"}}
for _model in (*VLM_MODELS, OOD):
    _weight = OOD_EXAMPLES if _model == OOD else NUM_EXAMPLES
    _whose = "the server's model out of domain" if _model == OOD else f"the {_model}'s model"
    for _score in (*CAPTION_SCORES, *VQA_SCORES, TASK_LOSS):
        _kind = CIDER if _score == "cider" else LOSS if _score == TASK_LOSS else PERCENT
        _name = f"{_model}-{_score}"
        _metric(
            _name,
            _kind,
            f"{_score} of {_whose}; the round's figure is weighted by the nodes' records",
            EVALUATE,
            combine=Combine("weighted", _name, _weight),
            # BLEU-1..3 stay in results.json and rounds.csv: fifteen curves would hide the scores read
            plot={CIDER: "captions.png", LOSS: "loss.png"}.get(_kind, "scores.png" if _score in _PLOTTED else ""),
            headline=_score in _HEADLINE[_model],
            label=_name if _model != OOD and _score in ("cider", "accuracy") else "",
        )
        if _model == CLIENT_MODEL and _score in ("cider", "accuracy"):  # each node's own model: how they spread
            _per_client(_name, _kind)

# privacy: a node's own accounts, and the one-run audit's figures from the audited node
NODE_EPSILON = _metric("node-epsilon", EPSILON, "a node's own account of what its reply releases", TRAIN)
NODE_EPSILON_RDP = _metric("epsilon-rdp", EPSILON, "a reprogramming node's epsilon by Opacus' RDP accountant", TRAIN)
NODE_EPSILON_PRV = _metric("epsilon-prv", EPSILON, "a reprogramming node's epsilon by Opacus' PRV accountant", TRAIN)
AUDIT_FIGURES = ("canaries", "guesses", "correct", "guessed-in", "epsilon-lower", "steps")  # privacy.audit's
AUDIT_METRICS = {
    figure: _metric(
        f"audit-{figure}",
        EPSILON if figure == "epsilon-lower" else COUNT,
        f"the one-run audit's {figure} (privacy.audit)",
        TRAIN,
    )
    for figure in AUDIT_FIGURES
}

# the server's own figures of a round
TRAIN_CLIENTS = _metric("train-clients", COUNT, "nodes whose training replies the round used", SERVER)
EVAL_CLIENTS = _metric("eval-clients", COUNT, "nodes whose evaluation replies the round used", SERVER)
TRAIN_COMPUTE_SECONDS = _metric(
    "train-compute-seconds", SECONDS, "the used training replies' compute-seconds, summed", SERVER
)
EVAL_COMPUTE_SECONDS = _metric(
    "eval-compute-seconds", SECONDS, "the used evaluation replies' compute-seconds, summed", SERVER
)
EPSILON_SPENT = _metric(
    "epsilon/per-record-max",
    EPSILON,
    "the largest epsilon a record of any node has spent so far, by the run's accountant (the ledger)",
    SERVER,
    label="epsilon",
)
EPSILON_MEAN = _metric(
    "epsilon/per-record-mean",
    EPSILON,
    "the epsilon a record has spent so far, averaged over the planned nodes (the ledger)",
    SERVER,
)
GDP_SIGMA = _metric("gdp-sigma", SIGMA, "std of the server's noise on the global-prompt gradient", SERVER)
GDP_DENOMINATOR = _metric(
    "gdp-denominator", COUNT, "what the server divides the global-prompt gradients' sum by", SERVER
)
FEDRAND_CLIENTS = {
    half: _metric(f"fedrand/clients-{half}", COUNT, f"FedRand: nodes that trained LoRA half {half}", SERVER)
    for half in ("A", "B")
}
