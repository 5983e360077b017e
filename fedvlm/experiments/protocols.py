"""Each seed paper's own protocol, and its headlines as claims the board's runs can settle.

    python -m fedvlm.experiments.protocols paper-dpfpl --docs

A protocol is what the paper ran, as docs/methods.md records it: its
methods and baselines, rounds, local training, clients, sampling, rank and privacy levels. It runs
on the family's embedded default, and unchanged on real CLIP weights and datasets (``--set
dataset=... clip.model=...``); the paper's own numbers are on its datasets, so they stand beside
ours as the claim, not as a target ours should hit.

A headline is a comparison the paper draws: ``better`` above ``worse`` on one figure at one
privacy level (or, with ``within``, not below it by more than that share). Its verdict
(``verdict``) rests on the difference paired by seed and its 95% interval
(``experiments.stats``): reproduced when the interval lies wholly on the paper's side, reversed
when it lies wholly on the other, not measurable when it covers the line or a row is missing, or,
for an attack's figure, when the attack is at its chance level in every run of both rows, or, for
a utility, when neither row is above the protocol's ``floor`` (a variant that trains nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fedvlm.experiments import stats
from fedvlm.experiments.presets import COMPARISONS
from fedvlm.experiments.sweep_report import (  # LAST10: a figure's key in a row
    LAST10,
    order_summary,
    shown_scale,
)
from fedvlm.metrics import ACC, SERVER_MODEL, vlm_score


@dataclass(frozen=True)
class Headline:
    claim: str  # the paper's claim, in words, with its numbers
    figure: str  # the sweep row key it is about (a utility's LAST10, or an attack's figure)
    better: str  # the variant the paper finds better
    worse: str
    epsilon: str  # the privacy level of both rows ('none' or a target)
    higher: bool = True  # a higher figure is better (False: an attack's AUC, lower = more private)
    within: float = 0.0  # > 0: the claim is "no worse than ``worse`` by more than this share"
    worse_epsilon: str = ""  # the worse row's level where it differs (privacy's cost: one method, two levels)

    def rows(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """(variant, privacy level) of the better and the worse row."""
        return (self.better, self.epsilon), (self.worse, self.worse_epsilon or self.epsilon)

    def pair(self) -> str:
        """The two rows as a page names them."""
        (a, ea), (b, eb) = self.rows()
        return f"{a} - {b} at epsilon {ea}" if ea == eb else f"{a} at epsilon {ea} - {b} at epsilon {eb}"


@dataclass(frozen=True)
class Protocol:
    name: str
    family: str
    summary: str  # what the paper ran, and what differs here
    variants: tuple[tuple[str, str, dict], ...]  # (label, method, run-config overrides)
    epsilons: tuple[str, ...]
    seeds: tuple[int, ...]
    clients: int
    sets: tuple[str, ...]  # the protocol's run config, for every run
    budget: str  # the CPU time it takes on the 2-core machine, measured
    headlines: tuple[Headline, ...]
    floor: str = ""  # a variant that trains nothing (zero-shot): a utility neither row beats is no learning
    private: tuple[str, ...] = ()  # the variants its targets run (the paper's private table); () = all that can


@dataclass(frozen=True)
class Verdict:
    headline: Headline
    outcome: str  # 'reproduced' | 'reversed' | 'not measurable'
    difference: stats.Spread | None  # better - worse (a relative share for a 'within' claim)
    why: str


def verdict(headline: Headline, rows: list[dict], floor: str = "") -> Verdict:
    """The headline judged on a protocol's sweep rows (finished runs, their seeds paired); ``floor``:
    the protocol's variant that trains nothing, whose utility neither row beating means there is no
    learning to compare, whatever the difference's interval."""
    a, b = (
        {int(r["seed"]): r.get(headline.figure) for r in rows if (r["variant"], r["epsilon"]) == row}
        for row in headline.rows()
    )
    if headline.within:  # each seed's share of its own base row, so that both rows' spread counts
        if not any(b.values()):
            return Verdict(headline, "not measurable", None, "no {} rows at epsilon {}".format(*headline.rows()[1]))
        a = {s: None if v is None or not b.get(s) else v / b[s] - 1 for s, v in a.items()}
        b = {s: 0.0 for s in b}
    diff = stats.difference(a, b)
    if diff is None:
        return Verdict(headline, "not measurable", None, "a row it compares was not run (or has no figure)")
    if diff.low is None or diff.high is None:
        return Verdict(headline, "not measurable", diff, "one seed: an interval needs two or more")
    if _at_chance(headline, rows):
        why = "the attack is at its chance level in every run of both rows (each run's interval covers it): "
        why += "no leak to compare"
        return Verdict(headline, "not measurable", diff, why)
    means = [spread.mean for spread in (stats.spread(a.values()), stats.spread(b.values())) if spread is not None]
    if (level := _floor(headline, rows, floor)) is not None and max(means) <= level:
        shown = level * shown_scale(headline.figure)  # as the page's tables show it
        why = f"neither row is above {floor} ({shown:.2f}), which trains nothing: no learning to compare"
        return Verdict(headline, "not measurable", diff, why)
    sign = 1.0 if headline.higher else -1.0
    line = -headline.within if headline.within else 0.0
    low, high = sorted((sign * diff.low, sign * diff.high))
    if low > line:
        return Verdict(headline, "reproduced", diff, "the whole interval lies on the paper's side")
    if high < line:
        return Verdict(headline, "reversed", diff, "the whole interval lies on the other side")
    return Verdict(headline, "not measurable", diff, "the interval covers the line: more seeds, or no difference")


def _floor(headline: Headline, rows: list[dict], floor: str) -> float | None:
    """The mean over seeds of ``floor``'s figure, for a utility headline (higher is better, not a
    share of its base row); None where there is none to hold the rows to."""
    if not floor or not headline.higher or headline.within:
        return None
    found = stats.spread(r.get(headline.figure) for r in rows if r["variant"] == floor)
    return None if found is None else found.mean


def _at_chance(headline: Headline, rows: list[dict]) -> bool:
    """Whether an attack headline compares two rows in which the attack found nothing: every run's
    interval of the figure (``-lo``, ``-hi``) covers its chance level (``-chance``,
    ``experiments.attack_report``). A difference of two chance figures says nothing of which
    method leaks less, whatever its interval."""
    f = headline.figure
    mine = [r for r in rows if (r["variant"], r["epsilon"]) in headline.rows() and r.get(f) is not None]
    return bool(mine) and all(_covers_chance(r, f) for r in mine)


def _covers_chance(row: dict, figure: str) -> bool:
    low, chance, high = (row.get(figure + end) for end in ("-lo", "-chance", "-hi"))
    return low is not None and chance is not None and high is not None and low <= chance <= high


def _acc(tag: str) -> str:
    """DP-FPL's figure: the mean of the last 10 rounds (its section 5)."""
    return ACC[tag] + LAST10


def _final(tag: str) -> str:
    """The trained model's figure, the last round's, where the paper reports that (a 10-round
    protocol's mean of the last 10 would average its whole training curve)."""
    return ACC[tag]


_DPFPL_SETS = (  # DP-FPL, Algorithm 1 and section 5: 10 clients, 100 rounds of one SGD step, B = 32, lr 1e-4
    "num-server-rounds=100",
    "partitioner=pathological",
    "prompt.batch-size=32",
    "prompt.optimizer=sgd",
    "prompt.lr=0.0001",
    "prompt.momentum=0.0",
    "prompt.local-steps=1",
    "prompt.n-ctx=16",
    "dpfpl.server-optimizer=sgd",
    "dpfpl.server-lr=0.0001",
    "privacy.clip=10.0",
)
_MOAP_SETS = (  # pFedMoAP's public code: 10 clients, 16 shots, 10 rounds of 5 epochs, CoOp's SGD
    "partitioner=pathological",
    "max-per-class=16",
    "fraction-train=1.0",
    "num-server-rounds=10",
    "prompt.local-epochs=5",
    "prompt.optimizer=sgd",
    "prompt.lr=0.002",
    "prompt.momentum=0.9",
    "prompt.weight-decay=0.0005",
    "prompt.batch-size=32",
    "prompt.n-ctx=16",
    # its private rows (Table 6) train as its rows without noise do: no 'auto' cut to one step
    "prompt.local-steps=0",
)
PROTOCOLS: dict[str, Protocol] = {
    p.name: p
    for p in (
        Protocol(
            "paper-dpfpl",
            "prompt",
            "DP-FPL (ICLR 2025), Table 1-3: ViT-B/16 on Caltech101, OxfordPets, Flowers102, Food101; here the "
            "embedded CLIP and its dataset. Epsilons 0.4, 0.1, 0.01 of the paper's 0.4 to 0.01, calibrated by the "
            "accountant with per-sample clipping (the paper's closed form and per-batch clipping do not give the "
            "epsilon they claim: docs/methods.md).",
            (
                ("zeroshot", "zeroshot", {}),  # the floor: what CLIP scores with no prompt learned
                ("promptfl", "promptfl", {}),
                ("dpfpl-r8", "dpfpl", {"dpfpl.rank": 8}),
                ("dpfpl-r8-nores", "dpfpl", {"dpfpl.rank": 8, "dpfpl.residual": False}),
                ("fedotp", "fedotp", {}),
                ("fedpgp", "fedpgp", {}),
                # the experiment behind its headlines here: at the paper's learning rates (1e-4,
                # for ViT-B/16) 100 single steps leave the embedded CLIP's prompts near zero-shot;
                # the same rows with both learning rates 100 times larger, where the prompts learn
                ("promptfl-lr0.01", "promptfl", {"prompt.lr": 0.01}),
                # and at those rates, the paper's rank ablation (its Figure 2b-c)
                *(
                    (f"dpfpl-r{k}-lr0.01", "dpfpl", {"dpfpl.rank": k, "prompt.lr": 0.01, "dpfpl.server-lr": 0.01})
                    for k in (8, 4, 2)
                ),
                # at rank 1 the embedded CLIP's noised pair (u, v) holds 96 coordinates, fewer than
                # the sweep's 100 audit canaries, each of which needs its own
                (
                    "dpfpl-r1-lr0.01",
                    "dpfpl",
                    {"dpfpl.rank": 1, "prompt.lr": 0.01, "dpfpl.server-lr": 0.01, "privacy.audit-canaries": 64},
                ),
            ),
            ("none", "0.4", "0.1", "0.01"),
            (0, 1, 2),
            10,
            _DPFPL_SETS,
            "measured 2026-12-02 and 03 on the 2-core machine, a 100-round run's rounds: PromptFL or DP-FPL 140 to "
            "230 s alone (1.4 to 2.3 s a round, private or not; 300 to 1,100 s while another job shares the two "
            "cores), DP-FPL without its residual 170 to 238 s, FedPGP 270 s (437 to 465 s beside a loopback "
            "deployment), FedOTP 620 to 760 s; so the headline rows (7 variants at epsilon 0.1, 3 at 0.01) are "
            "about 40 min a seed, 3.2 h for five; measured 2026-12-04 and 05, with the membership attacks: a run "
            "without noise 80 s, a private one 9 to 13 min (PromptFL and DP-FPL at epsilons none and 0.4, "
            "seeds 0-2)",
            (
                Headline(
                    "DP-FPL keeps more local accuracy than PromptFL under DP (epsilon 0.1, Caltech101: 92.71 vs 80.42)",
                    _acc("local"),
                    "dpfpl-r8",
                    "promptfl",
                    "0.1",
                ),
                Headline(
                    "DP-FPL generalises to the other clients' classes under DP better than PromptFL (epsilon 0.1, "
                    "Caltech101 neighbour accuracy 90.02)",
                    _acc("neighbor"),
                    "dpfpl-r8",
                    "promptfl",
                    "0.1",
                ),
                Headline(
                    "the same, with learning rates at which the embedded prompts learn (the experiment's rows)",
                    _acc("local"),
                    "dpfpl-r8-lr0.01",
                    "promptfl-lr0.01",
                    "0.1",
                ),
                Headline(
                    "... and on the other clients' classes",
                    _acc("neighbor"),
                    "dpfpl-r8-lr0.01",
                    "promptfl-lr0.01",
                    "0.1",
                ),
                Headline(
                    "DP-FPL above FedPGP on local accuracy under DP (the paper's Table 1, epsilon 0.1)",
                    _acc("local"),
                    "dpfpl-r8",
                    "fedpgp",
                    "0.1",
                ),
                Headline(
                    "the residual term helps (the paper's ablation, epsilon 0.1)",
                    _acc("local"),
                    "dpfpl-r8",
                    "dpfpl-r8-nores",
                    "0.1",
                ),
                Headline(
                    "DP-FPL above FedOTP on local accuracy under DP (Table 2, epsilon 0.1, Caltech101: 92.71 vs 84.98)",
                    _acc("local"),
                    "dpfpl-r8",
                    "fedotp",
                    "0.1",
                ),
                Headline(
                    "... and on the other clients' classes (Table 3, Caltech101: 90.02 vs 78.91)",
                    _acc("neighbor"),
                    "dpfpl-r8",
                    "fedotp",
                    "0.1",
                ),
                Headline(
                    "DP-FPL still above PromptFL under the strictest privacy (Table 2, epsilon 0.01, Caltech101: "
                    "85.21 vs 78.52)",
                    _acc("local"),
                    "dpfpl-r8",
                    "promptfl",
                    "0.01",
                ),
                Headline(
                    "the residual term helps under the strictest privacy, where the paper finds it helps most "
                    "(Figure 2, epsilon 0.01)",
                    _acc("local"),
                    "dpfpl-r8",
                    "dpfpl-r8-nores",
                    "0.01",
                ),
                Headline(
                    "a lower rank generalises better to the other clients' classes (Figure 2c, Caltech101: "
                    "'lower rank value tends to have higher utility'), at learning rates where the prompts learn",
                    _acc("neighbor"),
                    "dpfpl-r1-lr0.01",
                    "dpfpl-r8-lr0.01",
                    "0.1",
                ),
            ),
            "zeroshot",
        ),
        Protocol(
            "paper-fedrand",
            "vlm",
            "FedRand (seed: fedrand.txt): TinyLLaVA-OpenELM-450M, LoRA rank 8, 12 clients, 30% a round, 30 rounds, "
            "Dirichlet 0.5 on COCO and ScienceQA; here the embedded VLM and captions, no DP (the paper has none). "
            "MaxRényi asks for the paper's 300 members and 300 non-members a model and takes as many as the data "
            "has: on the embedded default 100 for the server model (its held-out split), per client what it holds.",
            (
                ("fedrand", "fedrand", {}),
                ("fedavg-lora", "fedavg-lora", {}),
                ("fedper-lora", "fedper-lora", {}),
                ("fedpara-lora", "fedpara-lora", {}),
            ),
            ("none",),
            (0, 1, 2),
            12,
            (
                "num-server-rounds=30",
                "fraction-train=0.3",
                "partitioner=dirichlet",
                "dirichlet-alpha=0.5",
                "lora.rank=8",
                "lora.lr=0.0003",
                "lora.local-epochs=1",
                "lora.batch-size=8",
            ),
            "measured 2026-12-02 on the 2-core machine: the 12 runs' rounds take 0.8 h in all (6 to 12 s a round), "
            "about 1 h with their attacks",
            (
                Headline(
                    "FedRand's server model within 1% of FedAvg-LoRA's (COCO CIDEr 110.27 vs 111.08)",
                    vlm_score(SERVER_MODEL, "cider"),  # the final server model, as the paper scores it
                    "fedrand",
                    "fedavg-lora",
                    "none",
                    within=0.01,
                ),
                Headline(
                    "the client models a server rebuilds leak less under FedRand (MaxRényi-10% AUROC 66.61 vs 70.22)",
                    "mia-clients-maxrenyi10-auc",
                    "fedrand",
                    "fedavg-lora",
                    "none",
                    higher=False,
                ),
            ),
        ),
        Protocol(
            "paper-reprogram",
            "reprogram",
            "Reprogrammable-FL (seed: reprogrammable-fl.md): ImageNet ResNets on CIFAR-10, 3 clients, IID, 100 "
            "rounds of DP-SGD (C = 1, z = 1.1, Poisson batches of 256, lr 0.15, epsilon 1.04); here the embedded "
            "source model on the motif task, with batches of 32 (reprogram.batch-size 'auto': a client holds about "
            "670 motifs), so the same z accounts a larger epsilon (the page's 'accounted eps').",
            (
                ("reprogram", "reprogram", {}),
                ("bl-pf", "bl-pf", {}),
                ("bl-ff", "bl-ff", {}),
                ("bl-ts", "bl-ts", {}),
            ),
            ("none",),
            (0, 1, 2),
            3,
            ("num-server-rounds=100", "partitioner=iid", "reprogram.lr=0.15", "reprogram.local-iterations=1"),
            "measured 2026-12-02 on the 2-core machine with nothing else running: a seed's four runs take about 12 "
            "min of rounds (1.2 to 2.3 s a round), about 13 min with their attacks; five seeds about 65 min",
            (
                Headline(
                    "model reprogramming beats the partial fine-tune under the same DP-SGD (CIFAR-10, epsilon "
                    "1.04: 79.08 vs 58.31)",
                    _final("local"),
                    "reprogram",
                    "bl-pf",
                    "none",
                ),
                Headline(
                    "model reprogramming beats the full fine-tune (79.08 vs 16.9)",
                    _final("local"),
                    "reprogram",
                    "bl-ff",
                    "none",
                ),
                Headline(
                    "model reprogramming beats training from scratch (79.08 vs 14.4)",
                    _final("local"),
                    "reprogram",
                    "bl-ts",
                    "none",
                ),
            ),
        ),
        Protocol(
            "paper-pfedmoap",
            "prompt",
            "pFedMoAP (seed: pfedmoap_slides.md, Table 1): RN50 on Flowers102, OxfordPets, Food101, Caltech101, "
            "DTD, 10 clients with disjoint classes, 16 shots; Table 6 at epsilon 50 and 25 (its DP mechanism not "
            "stated: here client DP-SGD on the prompt and the gating at every local step, docs/methods.md, with the "
            "rows' local epochs unchanged; the pfedmoap-upload row noises only the uploaded prompt, and its "
            "epsilon covers only that, not the personalised model its local accuracy is measured on); here the "
            "embedded CLIP and its dataset. This project's CoOp trains every round (the paper's trains once): a "
            "stronger baseline.",
            (
                *COMPARISONS["pfedmoap"],
                # the experiment behind FedOTP's shortfall: this project's FedOTP moves its global
                # prompt by one server step a round (DP-FPL's structure, where the server adds the
                # global noise), 0.01 x the mean gradient; FedOTP's own FedAvg of 10 local SGD steps
                # (lr 0.002, momentum 0.9) moves it about 0.08 x. The same method at that step:
                ("fedotp-server-lr0.1", "fedotp", {"prompt.local-steps": 0, "dpfpl.server-lr": 0.1}),
                # ... and FedOTP's own update: the global prompt trained on the node with the local
                # one, the server averaging the clients' global prompts (FedAvg)
                (
                    "fedotp-fedavg",
                    "fedotp",
                    {"prompt.local-steps": 0, "dpfpl.global-update": "local", "dpfpl.server-lr": 1.0},
                ),
                # the experiment behind Table 6's "no loss under DP": its mechanism is not stated; the
                # prompt's update noised once a round as it leaves (docs/methods.md's 'upload' placement,
                # which leaves the node's own gate and model outside the guarantee) against DP-SGD; a
                # once-a-round release has no per-record step for the audit's canaries to enter
                ("pfedmoap-upload", "pfedmoap", {"pfedmoap.dp-placement": "upload", "privacy.audit-canaries": 0}),
            ),
            ("none", "50", "25"),
            (0, 1, 2),
            10,
            _MOAP_SETS,
            "measured 2026-12-02 on the 2-core AMD machine, alone: 25 min for the 35 runs of the paper's variants at 5 "
            "seeds (0.4 h of rounds; FedOTP's runs 83 to 240 s each, the others 13 to 31 s), 8 min more for the "
            "FedOTP server-step experiment's 5 runs, 15 min for the fedotp-fedavg row's 5 (other jobs sharing "
            "the cores); measured 2026-12-05, alone: a private run 215 to 252 s for PromptFL, 323 to 360 s for "
            "pFedMoAP through DP-SGD, 31 to 46 s with the upload placement (the 40 runs at epsilon 50 and 25 over "
            "five seeds: about 2.3 h); measured 2026-12-05 on the Intel machine whose weights the published page's "
            "90 runs share, alone: 23 min for the 35 runs without noise, a private run's rounds 169 to 450 s for "
            "PromptFL, 297 to 1016 s for pFedMoAP through DP-SGD (the slowest before denormal floats were "
            "flushed), 31 to 35 s with the upload placement",
            (
                Headline(
                    "pFedMoAP above FedOTP on local accuracy (Flowers102: 98.41 vs 96.23)",
                    _final("local"),
                    "pfedmoap",
                    "fedotp",
                    "none",
                ),
                Headline(
                    "the local expert's weight helps (lambda 0.5 vs 0: 98.41 vs 97.61)",
                    _final("local"),
                    "pfedmoap",
                    "pfedmoap-lambda0",
                    "none",
                ),
                Headline(
                    "FedOTP far above PromptFL (96.23 vs 72.80)",
                    _final("local"),
                    "fedotp",
                    "promptfl",
                    "none",
                ),
                Headline(
                    "FedOTP far above CoOp (96.23 vs 70.14; the paper's CoOp trains once, ours every round)",
                    _final("local"),
                    "fedotp",
                    "coop",
                    "none",
                ),
                Headline(
                    "pFedMoAP above CoOp (98.41 vs 70.14)",
                    _final("local"),
                    "pfedmoap",
                    "coop",
                    "none",
                ),
                Headline(
                    "pFedMoAP keeps its accuracy under DP: within 1% of its own without noise (Table 6, epsilon 25 "
                    "vs none: 98.36 vs 98.41)",
                    _final("local"),
                    "pfedmoap",
                    "pfedmoap",
                    "25",
                    within=0.01,
                    worse_epsilon="none",
                ),
                Headline(
                    "pFedMoAP far above PromptFL under DP (Table 6, epsilon 50: 98.34 vs 67.07)",
                    _final("local"),
                    "pfedmoap",
                    "promptfl",
                    "50",
                ),
                Headline(
                    "pFedMoAP far above PromptFL under DP (Table 6, epsilon 25: 98.36 vs 64.25)",
                    _final("local"),
                    "pfedmoap",
                    "promptfl",
                    "25",
                ),
            ),
            # Table 6's rows, and the experiment on its mechanism
            private=("promptfl", "promptfl+fedprox", "pfedmoap", "pfedmoap-upload"),
        ),
    )
}

# The standard protocols of federated prompt learning (FLiP, FedOTP, FedPGP and pFedMoAP report
# them): the prompt methods without noise under each, no headline of their own (their tables are
# the result). Client counts past the board's 10 take more images per class of the embedded set.
_PROMPT_METHODS: tuple[tuple[str, str, dict], ...] = (
    *((m, m, {}) for m in ("zeroshot", "coop", "promptfl", "dpfpl", "fedotp", "fedpgp", "pfedmoap")),
    # DP-FPL and its baselines train one step a round (their Algorithm 1); the others local-epochs
    # full passes, about 8 times as many: the same methods at the others' compute
    *((f"{m}-matched", m, {"prompt.local-steps": 0}) for m in ("dpfpl", "fedotp", "fedpgp")),
)


def _standard(
    name: str, summary: str, clients: int, sets: tuple[str, ...], budget: str, headlines: tuple[Headline, ...] = ()
) -> Protocol:
    return Protocol(name, "prompt", summary, _PROMPT_METHODS, ("none",), (0, 1, 2), clients, sets, budget, headlines)


# pFedMoAP's many-client results (its CIFAR-100 table: 100 clients, 10% a round, Dirichlet 0.5),
# judged at each client count of the scaling protocol
_MANY_CLIENTS = (
    Headline(
        "pFedMoAP above PromptFL (CIFAR-100, 100 clients: 53.42 vs 45.00)",
        _acc("local"),
        "pfedmoap",
        "promptfl",
        "none",
    ),
    Headline(
        "pFedMoAP above local CoOp (CIFAR-100, 100 clients: 53.42 vs 48.74; the paper's CoOp trains once, this "
        "project's every round)",
        _acc("local"),
        "pfedmoap",
        "coop",
        "none",
    ),
    Headline(
        "local CoOp above PromptFL (CIFAR-100, 100 clients: 48.74 vs 45.00)", _acc("local"), "coop", "promptfl", "none"
    ),
)


PROTOCOLS.update(
    {
        p.name: p
        for p in (
            _standard(
                "base-to-novel",
                "CoCoOp's base-to-novel generalisation: train on the first half of the classes, score every node "
                "also on the other half (class-split = base-to-novel), 10 clients, pathological split of the base "
                "classes.",
                10,
                ("class-split=base-to-novel",),
                "measured 2026-12-02 on the 2-core machine: 8 min for the 21 runs of the seven methods at three seeds "
                "(0.1 h of rounds), 2 min for the DP-FPL and FedPGP -matched rows; FedOTP's -matched rows 1 to 8 min "
                "each on 2026-12-03 (most of it other jobs' load)",
            ),
            *(
                _standard(
                    f"dirichlet-{alpha:g}",
                    f"Dirichlet label skew at alpha {alpha:g}, 10 clients (smaller alpha: fewer classes per client).",
                    10,
                    ("partitioner=dirichlet", f"dirichlet-alpha={alpha:g}"),
                    f"measured 2026-12-02 on the 2-core machine: {minutes} min for the 21 runs of the seven methods at "
                    "three seeds (pFedMoAP's the longest, 2 to 6 min each; other jobs shared the cores at times), 4 to "
                    "11 min for the DP-FPL and FedPGP -matched rows; FedOTP's -matched rows 1 to 7 min each on "
                    "2026-12-03 (most of it other jobs' load)",
                )
                for alpha, minutes in ((0.1, 25), (0.5, 18), (1.0, 13))
            ),
            *(
                _standard(
                    f"clients-{n}",
                    f"{n} clients, 10% of them a round, Dirichlet 0.5 (pFedMoAP's CIFAR setup), on an embedded set of "
                    "640 images a class.",
                    n,
                    ("partitioner=dirichlet", "dirichlet-alpha=0.5", "fraction-train=0.1", "embedded-per-class=640"),
                    budget,
                    _MANY_CLIENTS,
                )
                for n, budget in (
                    (
                        10,
                        "measured 2026-12-05 on the 2-core Intel machine, alone: 21 min for the 30 runs at three seeds "
                        "(0.3 h of rounds; FedOTP's 1.5 min each and its -matched rows 2.6, the others under 1)",
                    ),
                    (
                        50,
                        "measured 2026-12-03 on the 2-core machine: 1.4 h of rounds for the 30 runs at three seeds "
                        "(PromptFL's 6 to 7 min each, CoOp's 3 to 6, FedOTP's 1.4 to 25 beside other jobs, the others "
                        "under 4); PromptFL's and pFedMoAP's seeds 3 and 4 (`--variants promptfl,pfedmoap --seeds "
                        "0,1,2,3,4`) 50 to 61 s each on 2026-12-04, alone on the machine",
                    ),
                    (
                        100,
                        "measured 2026-12-04 on the 2-core machine: 0.8 h of rounds for the 30 runs at three seeds "
                        "(FedOTP's 2.5 to 3.6 min each, CoOp's and PromptFL's 0.7 to 7 min beside a benchmark, the "
                        "others under 1.6 min); PromptFL's and pFedMoAP's seeds 3 and 4 (`--variants promptfl,pfedmoap "
                        "--seeds 0,1,2,3,4`) 60 to 101 s each, alone on the machine",
                    ),
                )
            ),
        )
    }
)


def scale_of(protocol: Protocol, quick: bool, seeds: tuple[int, ...], attacks: bool):
    """The leaderboard's ``Scale`` of a protocol (``--quick``: the CI-sized rounds and data)."""
    from fedvlm.experiments.leaderboard import FULL, QUICK, QUICK_FAMILY, Scale

    size = QUICK if quick else FULL
    sets = (*protocol.sets, *(size.sets + QUICK_FAMILY.get(protocol.family, ()) if quick else ()))
    chosen = seeds or (size.seeds if quick else protocol.seeds)
    clients = size.clients if quick else protocol.clients
    return Scale(protocol.epsilons, chosen, clients, size.audit, size.shadows if attacks else 0, sets)


def markdown(protocol: Protocol, verdicts: list[Verdict], board_lines: list[str], rows: list[dict]) -> list[str]:
    """The protocol's page: what the paper ran and what differs here, the budget, each headline
    with its verdict and the figures it reads, then the board's tables of its runs."""
    head = [
        "| headline (the paper's words and numbers) | figure | rows | Δ [95% CI] | verdict |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        h, d = v.headline, v.difference
        scale = 100.0 if h.within else shown_scale(h.figure)
        delta = "-" if d is None else d.interval(scale) + (" % of the worse row" if h.within else "")
        head.append(f"| {h.claim} | {h.figure} | {h.pair()} | {delta} | **{v.outcome}**: {v.why} |")
    title, *rest = board_lines
    intro = [title, "", protocol.summary, "", f"CPU budget: {protocol.budget}.", "", "## Headlines", "", *head]
    return [*intro, *_figures(protocol, rows), "", "## The runs", *rest]


def _figures(protocol: Protocol, rows: list[dict]) -> list[str]:
    """Each figure a headline reads, per row: mean ± std over seeds (ddof 1), so that a headline
    on the last round's figure is read beside the board's means of the last 10 rounds."""
    out: list[str] = []
    for figure in dict.fromkeys(h.figure for h in protocol.headlines):
        scale = shown_scale(figure)
        read = {eps for h in protocol.headlines if h.figure == figure for _, eps in h.rows()}
        epsilons = [e for e in protocol.epsilons if e in read and any(r["epsilon"] == e for r in rows)]
        if not epsilons:  # no row of this call at a level the figure is read at
            continue
        out += [
            "",
            f"`{figure}` per row (mean ± std over seeds):",
            "",
            "| variant | " + " | ".join(f"eps={e}" for e in epsilons) + " |",
        ]
        out.append("|---" * (1 + len(epsilons)) + "|")
        for label, _, _ in protocol.variants:
            cells = []
            for eps in epsilons:
                got = stats.spread(r.get(figure) for r in rows if r["variant"] == label and r["epsilon"] == eps)
                cells.append("-" if got is None else f"{got.text(scale)} ({got.n})")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def headline_cells(protocol: Protocol) -> dict[str, set[str]]:
    """The rows each privacy level's headlines compare, in the protocol's order of privacy levels:
    the least a verdict needs (a row compared at one level is not run at the others)."""
    cells: dict[str, set[str]] = {e: set() for e in protocol.epsilons}
    for h in protocol.headlines:
        for label, eps in h.rows():
            cells[eps].add(label)
    if protocol.floor:  # it trains nothing: it runs without noise only
        cells["none"].add(protocol.floor)
    return {e: labels for e, labels in cells.items() if labels}


def left_out(protocol: Protocol) -> str:
    """The page's note on a run of the headline rows only: which of the protocol's cells it has not run."""
    cells = headline_cells(protocol)
    ran = "; ".join(f"{', '.join(sorted(labels))} at epsilon {e}" for e, labels in cells.items())
    rest = []
    for e in protocol.epsilons:
        runs = runs_at(protocol, list(protocol.variants), e)
        missing = [label for label, _, _ in runs if label not in cells.get(e, set())]
        if len(missing) == len(runs):
            rest.append(f"epsilon {e} (all)")
        elif missing:
            rest.append(f"{', '.join(missing)} at epsilon {e}")
    return f"**Headline rows only**: {ran}. Not run for this page: {'; '.join(rest) or 'nothing'}."


def _selection(p: argparse.ArgumentParser, args, protocol: Protocol) -> dict[str, list]:
    """The variants asked for at each privacy level; a page (--docs) is the whole protocol or its
    headline rows."""
    chosen = set(args.variants.split(",")) - {""}
    asked = set(args.epsilons.split(",")) - {""}
    if args.headline_rows:
        if chosen or asked:
            p.error("--headline-rows chooses the variants and epsilons itself: drop --variants and --epsilons")
        cells = headline_cells(protocol)
        return {e: [v for v in protocol.variants if v[0] in labels] for e, labels in cells.items()}
    unknown = chosen - {label for label, _, _ in protocol.variants}
    if unknown:
        p.error(f"--variants: {', '.join(sorted(unknown))} not among {', '.join(v[0] for v in protocol.variants)}")
    unknown_eps = sorted(asked - set(protocol.epsilons))
    if unknown_eps:
        p.error(f"--epsilons: {', '.join(unknown_eps)} not among {', '.join(protocol.epsilons)}")
    variants = [v for v in protocol.variants if not chosen or v[0] in chosen]
    part = chosen and len(variants) < len(protocol.variants) or asked and asked < set(protocol.epsilons)
    if args.docs and part:  # a page of a part would replace the whole's
        p.error(
            "--docs with part of the protocol (--variants or --epsilons) would publish a page of that part only: "
            "run the part without --docs, then the whole protocol (or --headline-rows) with --docs"
        )
    # a level none of the chosen variants runs at is left out: a sweep given no variant would run
    # every DP method of the family in the protocol's folder
    from fedvlm.runconfig import ConfigError

    levels = [e for e in protocol.epsilons if not asked or e in asked]
    try:
        return {e: runs for e in levels if (runs := runs_at(protocol, variants, e))}
    except ConfigError as err:
        p.error(f"the protocol's config with --set {' '.join(args.set)} is refused: {err}")


def runs_at(protocol: Protocol, variants: list, epsilon: str) -> list:
    """Those of ``variants`` a privacy level runs: all at 'none'; at a target, those of the
    protocol's ``private`` (where it names them) whose config
    (the protocol's, the variant's overrides, the target) the validation accepts. A method without
    a DP mechanism, or a variant without privacy accounting (FedOTP's global prompt stepped on the
    node), is refused there, as a user asking for it would be. A variant whose config is refused
    without noise too (a mistyped ``--set``) raises ``ConfigError``: that is the user's to mend, not
    a row to leave out."""
    from fedvlm.experiments.presets import setup
    from fedvlm.experiments.sweep import without_noise
    from fedvlm.methods.validation import validate
    from fedvlm.runconfig import ConfigError

    base = setup(None, list(protocol.sets), None)[0]  # the protocol's sets, parsed as the sweep parses them
    for v in variants:
        validate(without_noise(base | v[2]) | {"method": v[1], "privacy.epsilon": 0.0})
    if epsilon == "none":
        return list(variants)
    variants = [v for v in variants if not protocol.private or v[0] in protocol.private]
    kept = []
    for v in variants:
        raw = base | v[2] | {"method": v[1]}
        try:
            validate(raw | {"privacy.epsilon": float(epsilon)})
        except ConfigError:
            continue
        kept.append(v)
    return kept


def _parser():
    from fedvlm.experiments.sweep import whole_numbers

    p = argparse.ArgumentParser(prog="python -m fedvlm.experiments.protocols", description=__doc__.split("\n\n")[0])
    p.add_argument("protocol", choices=sorted(PROTOCOLS))
    p.add_argument("--out", type=Path, default=Path.home() / "fedvlm-protocols")
    p.add_argument("--quick", action="store_true", help="CI-sized: 2 rounds, 3 clients, one seed")
    p.add_argument("--seeds", type=whole_numbers, default="", help="override the protocol's seeds, e.g. 0,1,2,3,4")
    p.add_argument("--variants", default="", help="comma-separated labels: run only these of the protocol's")
    p.add_argument("--epsilons", default="", help="comma-separated: only these of the protocol's privacy levels")
    p.add_argument("--no-attacks", action="store_true", help="skip the membership attacks (utility headlines only)")
    p.add_argument(
        "--headline-rows",
        action="store_true",
        help="only the variants and epsilons the headlines compare; with --docs the page names the cells left out",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides after the protocol's own, e.g. real weights and data: dataset=... clip.model=...",
    )
    p.add_argument("--docs", action="store_true", help="also write docs/results/<protocol>.md, its plot and JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    import logging
    import sys
    import time

    from fedvlm.experiments import leaderboard
    from fedvlm.experiments.sweep_report import read_summary

    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # the user's overrides come after the protocol's, so they win; every run's config is still validated
    protocol = dataclasses.replace(PROTOCOLS[args.protocol], sets=(*PROTOCOLS[args.protocol].sets, *args.set))
    cells = _selection(p, args, protocol)
    scale = scale_of(protocol, args.quick, args.seeds, not args.no_attacks)
    cells = {e: v for e, v in cells.items() if e in scale.epsilons}
    if not cells:
        p.error(f"--epsilons: none of {args.epsilons} is run at this scale ({', '.join(scale.epsilons)})")
    out = args.out.expanduser().resolve()
    folder, t0 = out / protocol.name, time.time()
    _run(protocol, cells, scale, folder)
    wanted = {(v[0], e) for e, variants in cells.items() for v in variants}
    rows = [
        {**r, "family": protocol.family}
        for r in (read_summary(folder / "summary.csv") if (folder / "summary.csv").exists() else [])
        if (r["variant"], r["epsilon"]) in wanted
    ]
    if not rows:
        p.error(f"no run of these variants and epsilons in {folder / 'summary.csv'}: the report is left as it was")
    entries = leaderboard.board(rows)
    verdicts = [verdict(h, [r for r in rows if r["status"] != "failed"], protocol.floor) for h in protocol.headlines]
    command = "python -m fedvlm.experiments.protocols " + " ".join(argv if argv is not None else sys.argv[1:])
    title = f"Protocol {protocol.name}: the paper's setup " + (
        f"with {' '.join(args.set)}" if args.set else "on the embedded default"
    )
    board = leaderboard.board_markdown(entries, command.strip(), time.time() - t0, title)
    lines = markdown(protocol, verdicts, board, [r for r in rows if r["status"] != "failed"])
    if args.headline_rows:
        lines[1:1] = ["", left_out(protocol)]
    found = [{"claim": v.headline.claim, "outcome": v.outcome, "why": v.why} | _difference(v) for v in verdicts]
    leaderboard.write_outputs(entries, out, protocol.name, lines, command, {"headlines": found})
    if args.docs:
        leaderboard.copy_to_docs(out, protocol.name)
    print((out / f"{protocol.name}.md").read_text())
    return 0


def _run(protocol: Protocol, cells: dict[str, list], scale, folder: Path) -> None:
    """Every cell through the sweep, one call per set of variants (finished runs reused), and
    summary.csv left with every row of the folder's calls, these and the earlier ones."""
    from fedvlm.experiments import leaderboard, sweep

    labels = [label for label, _, _ in protocol.variants]
    for epsilons, variants in _calls(cells):
        labelled = [a for label, method, o in variants for a in ("--variant", label, method, *leaderboard.pairs(o))]
        sweep.main([*leaderboard.sweep_argv(folder, [], scale, epsilons), *labelled, "--set", *scale.sets])
        order_summary(folder / "summary.csv", labels, protocol.epsilons)


def _calls(cells: dict[str, list]) -> list[tuple[tuple[str, ...], list]]:
    """One sweep per set of variants, over the privacy levels that run exactly that set (a sweep
    runs every variant at every level it is given)."""
    calls: dict[tuple[str, ...], tuple[list, list[str]]] = {}
    for eps, variants in cells.items():
        calls.setdefault(tuple(v[0] for v in variants), (variants, []))[1].append(eps)
    return [(tuple(epsilons), variants) for variants, epsilons in calls.values()]


def _difference(v: Verdict) -> dict:
    return {} if v.difference is None else {"difference": v.difference.as_dict()}


if __name__ == "__main__":
    raise SystemExit(main())
