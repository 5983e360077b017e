"""Reprogrammable-FL: the models, Opacus' per-sample gradients against torch.func, the privacy
accounting against dp-accounting, the node's accountant across rounds, and federations of
each method through the real strategy and ClientApp."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedvlm.client_app.privacy_floor import RunLedger
from fedvlm.methods.validation import validate
from fedvlm.models.reprogram import InputProgram, build_model, load_source, trainable_state
from fedvlm.runconfig import ConfigError
from fedvlm.spec import spec_of


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return load_source("embedded-tiny-resnet", "random", tmp_path_factory.mktemp("c"))


# ---- models --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,expected", [("mr", 160538), ("pf", 20490), ("ff", 23528522), ("ts", 23528522)])
def test_trainable_parameters_match_the_papers_table_iv(tmp_path, kind, expected):
    # ResNet-50 source, CIFAR-10 (10 classes), 200 px images padded to 224 (Table IV's first column)
    src = load_source("resnet50", "random", tmp_path)
    model = build_model(kind, src, 10, 200, seed=0)
    assert sum(v.numel() for v in trainable_state(model).values()) == expected


def test_input_program_pads_the_image_and_perturbs_only_the_border():
    prog = InputProgram(source_size=8, image_size=4)
    with torch.no_grad():
        prog.theta.uniform_(-2, 2)
    x = torch.rand(2, 3, 4, 4)
    out = prog(x)
    assert out.shape == (2, 3, 8, 8)
    assert torch.equal(out[:, :, 2:6, 2:6], x)  # the image itself is untouched
    border = out.clone()
    border[:, :, 2:6, 2:6] = 0
    expected = torch.tanh(prog.theta * prog.mask()).expand(2, -1, -1, -1)
    assert torch.allclose(border, expected)
    assert float(border.detach().abs().max()) < 1.0 and float(border.detach().abs().sum()) > 0
    with pytest.raises(ValueError, match="must be in 1..8"):
        InputProgram(8, 9)


def test_frozen_source_stays_in_eval_mode_and_never_changes(tiny_source):
    model = build_model("mr", tiny_source, 10, 24, seed=0)
    before = {k: v.clone() for k, v in model.source.state_dict().items()}
    model.train()
    assert not model.source.net.training and model.program.training
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        loss = F.cross_entropy(model(torch.rand(8, 3, 24, 24)), torch.randint(0, 10, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.source.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BatchNorm statistics
    assert set(trainable_state(model)) == {"program.theta", "output_map.weight", "output_map.bias"}


def test_full_network_baselines_replace_batchnorm(tiny_source):
    for kind in ("ff", "ts"):
        model = build_model(kind, tiny_source, 10, 24, seed=0)
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
        assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    pf = build_model("pf", tiny_source, 10, 24, seed=0)
    assert set(trainable_state(pf)) == {"head.weight", "head.bias"}
    ts, ff = build_model("ts", tiny_source, 10, 24, seed=0), build_model("ff", tiny_source, 10, 24, seed=0)
    conv = "body.conv1.weight"
    assert torch.equal(trainable_state(ff)[conv], tiny_source.model.conv1.weight)
    assert not torch.equal(trainable_state(ts)[conv], tiny_source.model.conv1.weight)


@pytest.mark.parametrize("kind", ["mr", "pf", "ff"])
def test_opacus_per_sample_gradients_match_torch_func(tiny_source, kind):
    from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights
    from torch.func import functional_call, grad, vmap

    model = build_model(kind, tiny_source, 10, 24, seed=0)
    with torch.no_grad():
        for p in trainable_state(model).values():
            p.add_(0.05 * torch.randn_like(p))  # away from zero init, so tanh' matters
    size = 24 if kind == "mr" else 32
    x, y = torch.rand(5, 3, size, size), torch.randint(0, 10, (5,))
    names = list(trainable_state(model))
    params = {k: v.detach().clone() for k, v in trainable_state(model).items()}

    def loss_one(p, xi, yi):
        out = functional_call(model, p, (xi[None],))
        return F.cross_entropy(out, yi[None])

    model.train()  # Opacus records activations in training mode; the frozen source stays in eval
    reference = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    wrapper = GradSampleModuleExpandedWeights if kind == "ff" else GradSampleModule
    gsm = wrapper(model, batch_first=True, loss_reduction="mean")
    F.cross_entropy(gsm(x), y).backward()
    got = dict(model.named_parameters())
    for k in names:
        assert got[k].grad_sample.shape == reference[k].shape, k
        assert torch.allclose(got[k].grad_sample, reference[k], atol=1e-5, rtol=1e-4), k


# ---- config --------------------------------------------------------------------------------


def test_family_defaults_and_refusals():
    cfg = validate({"method": "reprogram"})
    assert cfg.dataset == "motifs" and cfg.partitioner == "iid"
    assert cfg.reprogram.source_model == "embedded-motif-resnet" and cfg.reprogram.image_size == 24
    assert cfg.privacy.clip == 1.0 and cfg.privacy.noise_multiplier == 1.1  # the paper's DP-SGD
    assert cfg.reprogram.batch_size == 32
    digits = validate({"method": "bl-ff", "dataset": "digits"})
    assert digits.reprogram.source_model == "embedded-tiny-resnet" and digits.reprogram.batch_size == 32
    real = validate({"method": "bl-pf", "dataset": "cifar10", "data-root": "/data"})
    assert real.reprogram.source_model == "resnet50" and real.reprogram.image_size == 200
    assert real.reprogram.batch_size == 256
    assert validate({"method": "dpfpl"}).privacy.clip == 10.0  # other families keep theirs
    assert validate({"method": "dpfpl"}).privacy.noise_multiplier == 0.0
    with pytest.raises(ConfigError, match="exceeds the source model's input size 32"):
        validate({"method": "reprogram", "reprogram.image-size": 40})
    with pytest.raises(ConfigError, match="set privacy.calibration='accountant'"):
        validate({"method": "reprogram", "privacy.calibration": "paper"})
    with pytest.raises(ConfigError, match="always clips per sample"):
        validate({"method": "bl-ff", "privacy.clipping": "per-batch"})
    with pytest.raises(ConfigError, match="does not fit method 'reprogram'"):
        validate({"method": "reprogram", "dataset": "embedded-captions"})


def test_the_config_knows_every_source_model_and_its_input_size(tmp_path):
    from fedvlm.models import embedded_resnet
    from fedvlm.models.reprogram import SOURCE_MODELS
    from fedvlm.runconfig import EMBEDDED_SOURCE_INPUT, EMBEDDED_SOURCES
    from fedvlm.runconfig.schema import KEY_BY_NAME

    assert KEY_BY_NAME["reprogram.source-model"].choices == ("auto", *SOURCE_MODELS)
    assert EMBEDDED_SOURCES == tuple(embedded_resnet.SOURCES)
    for name in EMBEDDED_SOURCES:
        assert load_source(name, "random", tmp_path).input_size == EMBEDDED_SOURCE_INPUT
    with pytest.raises(ConfigError, match="exceeds the source model's input size 224"):
        validate({"method": "reprogram", "reprogram.source-model": "resnet18", "reprogram.image-size": 225})


def test_the_motif_source_has_240_classes_and_a_million_weights(tmp_path):
    src = load_source("embedded-motif-resnet", "random", tmp_path)
    assert src.num_source_classes == 240 and "NOT pretrained" in src.weights
    counts = {
        k: sum(v.numel() for v in trainable_state(build_model(k, src, 10, 24, seed=0)).values())
        for k in "mr pf ff".split()
    }
    # the output map reads 240 logits, the new head 256 features; full fine-tuning trains 1.27 M
    assert counts == {"mr": 3 * 32 * 32 + 240 * 10 + 10, "pf": 256 * 10 + 10, "ff": counts["ff"]}
    assert 1_200_000 < counts["ff"] < 1_300_000


def test_bloodmnist_npz_and_missing_files(tmp_path):
    from fedvlm.data.registry import DatasetError, load_dataset

    with pytest.raises(DatasetError, match="bloodmnist.npz"):
        load_dataset("bloodmnist", data_root=str(tmp_path))
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "bloodmnist.npz",
        train_images=rng.integers(0, 255, (16, 28, 28, 3), dtype=np.uint8),
        train_labels=rng.integers(0, 8, (16, 1)),
        test_images=rng.integers(0, 255, (6, 28, 28, 3), dtype=np.uint8),
        test_labels=rng.integers(0, 8, (6, 1)),
        val_images=np.zeros((1, 28, 28, 3), np.uint8),
        val_labels=np.zeros((1, 1)),
    )
    d = load_dataset("bloodmnist", data_root=str(tmp_path))
    assert d.n_classes == 8 and len(d.train) == 16 and len(d.test) == 6 and d.classnames[-1] == "platelet"
    assert d.train.image(0).size == (28, 28)


# ---- federations ---------------------------------------------------------------------------


def _federation(make_cfg, n=3, **overrides):
    """A federation on the digits task with the tiny source unless ``overrides`` say otherwise
    (fast: the motif source needs minutes of pretraining)."""
    from fedvlm.client_app.app import app as client_app
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    cfg = make_cfg(**{"dataset": "digits", **overrides})
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict())
    return execute(cfg, grid, run_id="test"), grid


def test_epsilon_after_k_rounds_is_dp_accountings_and_the_nodes_accountant_persists(make_cfg, cache_dir):
    import dp_accounting

    rounds, steps = 3, 2
    rec, grid = _federation(make_cfg, method="reprogram", num_server_rounds=rounds, reprogram__local_iterations=steps)
    ledger = rec.data["privacy"]
    nodes = {n["name"]: n for n in rec.data["run"]["nodes"]}
    for k, entry in enumerate(ledger["rounds"], start=1):
        for client, figures in entry["by_accountant"].items():
            n = nodes[client]["num_train"]
            q = 32 / n
            direct = {}
            for name, acc in (
                ("rdp", dp_accounting.rdp.RdpAccountant()),
                ("pld", dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)),
            ):
                acc.compose(
                    dp_accounting.SelfComposedDpEvent(
                        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)), k * steps
                    )
                )
                direct[name] = acc.get_epsilon(1e-5)
            assert figures["rdp"] == pytest.approx(direct["rdp"], rel=1e-9)
            assert figures["pld"] == pytest.approx(direct["pld"], rel=1e-9)
            # the node's own Opacus accountant, kept in its state across rounds, agrees
            mine = entry["client_reported"][client]
            assert mine["rdp"] == pytest.approx(direct["rdp"], rel=2e-2)
            assert mine["prv"] == pytest.approx(direct["pld"], rel=5e-2)
    # every node's one ledger covers all rounds (never restarted)
    for ctx in grid.contexts.values():
        rows = RunLedger(ctx.state).rows()  # nodes without a state-dir: the run's ledger
        assert [r["round"] for r in rows] == list(range(1, rounds + 1))
        assert sum(r["steps"] for r in rows) == rounds * steps and all(r["noise-multiplier"] == 1.1 for r in rows)
    eps = [r["epsilon"] for r in ledger["rounds"]]
    assert eps == sorted(eps) and eps[0] > 0
    # no server mechanism: a record's epsilon is its client's DP-SGD alone
    assert all(
        r["changed"][c] == pytest.approx(r["by_accountant"][c]["rdp"]) for r in ledger["rounds"] for c in r["changed"]
    )
    plan = next(iter(ledger["client_mechanisms"].values()))["dp-sgd"]
    assert plan["noise_multiplier"] == pytest.approx(1.1) and plan["clip"] == 1.0


@pytest.mark.parametrize("method", ["reprogram", "bl-ff", "bl-pf", "bl-ts"])
def test_each_method_federates_and_shares_only_what_trains(make_cfg, method):
    rec, grid = _federation(make_cfg, method=method, num_server_rounds=2, reprogram__local_iterations=3)
    rounds = rec.data["rounds"]
    assert len(rounds) == 2 and not any(r["dropped"] for r in rounds)
    assert all(np.isfinite(r["metrics"]["local-acc"]) for r in rounds)
    sent = {k for m in grid.replies if not m.has_error() and "arrays" in m.content for k in m.content["arrays"].keys()}
    from fedvlm.models.reprogram import initial_model

    cfg = make_cfg(method=method, dataset="digits")
    expected = set(trainable_state(initial_model(cfg, spec_of(cfg).model_kind, 10)))
    assert sent == expected
    assert rec.data["privacy"]["rounds"][-1]["epsilon"] > 0


def test_the_default_motifs_task_federates_on_the_motif_architecture(make_cfg):
    # random source weights: the architecture and the task of the default path, without the
    # minutes of pretraining (tests/unit/test_motifs.py pretrains the real recipe, marked slow)
    rec, grid = _federation(
        make_cfg, method="reprogram", dataset="motifs", reprogram__source_weights="random", num_server_rounds=1
    )
    node = rec.data["run"]["nodes"][0]
    assert node["num_train"] in (666, 667) and node["num_test"] == 200
    # the run names the source weights it started from: those every node reported loading
    assert {n["backbone"] for n in rec.data["run"]["nodes"]} == {rec.data["run"]["backbone"]["fingerprint"]}
    shapes = {
        k: tuple(a.shape)
        for m in grid.replies
        if not m.has_error() and "arrays" in m.content
        for k, a in m.content["arrays"].items()
    }
    assert shapes == {"program.theta": (3, 32, 32), "output_map.weight": (10, 240), "output_map.bias": (10,)}
    assert "NOT pretrained" in json.dumps(rec.data["run"])


def test_the_global_model_attack_takes_every_trained_record_against_the_test_records(make_cfg):
    """The family's membership attack (``attacks.global_model``) on what a run publishes: every
    training record of the nodes that trained is a member, every test record a non-member, and
    each attack pools them into one ROC with intervals, as the sweep and the leaderboard read it."""
    from fedvlm.attacks.global_model import pooled_attacks
    from fedvlm.attacks.reports import GLOBAL as REPORT
    from fedvlm.experiments.sweep import attack_columns
    from fedvlm.methods.registry import get_method

    rec, _ = _federation(
        make_cfg, method="bl-pf", num_server_rounds=2, reprogram__source_weights="random", privacy__noise_multiplier=0.0
    )
    pooled = pooled_attacks(rec.dir)
    report = json.loads((rec.dir / REPORT).read_text())
    nodes = rec.data["run"]["nodes"]
    assert report["members"] == sum(n["num_train"] for n in nodes) and report["nonmembers"] == sum(
        n["num_test"] for n in nodes
    )
    assert set(pooled) == {"global-loss", "global-calibrated"}
    for attack in pooled.values():
        low, high = attack["auc"]["ci95"]
        assert 0 <= low <= attack["auc"]["value"] <= high <= 1 and 0 <= attack["tpr@0.1%fpr"]["value"] <= 1
    # the report's mean final-model loss on the test records is the model's own test loss
    assert report["mean_loss"]["out-final"] == pytest.approx(
        rec.data["rounds"][-1]["metrics"]["local-loss-weighted"], rel=1e-4
    )
    # the sweep's columns come from the family's hook, read back from the report just written
    columns = attack_columns(rec.dir, get_method("bl-pf").family, shadows=0, online=0)
    assert columns["mia-global-loss-auc"] == pooled["global-loss"]["auc"]["value"] and "mia-error" not in columns
