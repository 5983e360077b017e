"""Pretrain the embedded models of some method families into a cache, once: what a Docker image
bakes in at build time so that no container pretrains at run time (a first ``flwr run`` would
otherwise wait minutes on every node, past the server's handshake timeout).

    python -m fedvlm.models.prepare --cache-dir /opt/fedvlm-cache --family prompt

The prompt family loads the embedded tiny CLIP, the VLM family the tiny VLM, and Reprogrammable-FL
the reprogramming sources (``embedded_resnet.SOURCES``; the label-smoothed ablation source only
with ``--all``). Every recipe is seeded and the cache is keyed by it, so the weights are the ones
any machine would pretrain. Each family's models are imported only when that family is prepared:
``docker/Dockerfile`` pretrains each family in its own build stage, which copies exactly the
modules that family's pretraining imports (``tests/unit/test_deploy.py`` keeps the two in step),
so an edit to one family's model re-pretrains only that family.

An image sets ``FEDVLM_PRETRAINING=refuse``: there a missing embedded model is an error that
names the build argument that bakes it in, not a pretraining that outlasts every timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

# family -> the module whose ``embedded_models(cache_dir, everything)`` names and makes its models
# (tests/unit/test_deploy.py checks the keys against the method registry's families)
FAMILY_MODELS = {
    "prompt": "fedvlm.models.tiny_clip",
    "vlm": "fedvlm.models.tiny_vlm",
    "reprogram": "fedvlm.models.embedded_resnet",
}
# the build argument of docker/Dockerfile that bakes each family's models into the image
BUILD_ARGS = {family: f"EMBEDDED_{family.upper()}" for family in FAMILY_MODELS}
REFUSE = "refuse"  # FEDVLM_PRETRAINING's value in an image
# the threads every pretraining computes with: the Intel machine's published weights were made on
# two (its default; bench/backbone_kernels.py), and the AMD machine had two cores as well
PRETRAIN_THREADS = 2


class NotInImage(RuntimeError):
    """An embedded model the image was built without."""


@contextlib.contextmanager
def pretraining(family: str, model: str) -> Iterator[None]:
    """Around each embedded model's pretraining. In an image that baked its models in
    (``FEDVLM_PRETRAINING=refuse``) a missing one is an error with the fix. Elsewhere the
    pretraining runs on ``PRETRAIN_THREADS`` threads, whatever the process was given (a simulated
    client has one): the thread count decides how reductions split, and one thread gives other
    weights than two on the same CPU (docs/results/backbone-kernels.json), so without the pin a
    cache's weights would depend on which process happened to pretrain first, and two machines of
    one CPU model on their core counts."""
    if os.environ.get("FEDVLM_PRETRAINING") == REFUSE:
        raise NotInImage(
            f"the embedded model {model!r} (method family {family!r}) is not in this image, and pretraining it "
            f"here would take minutes on every node: rebuild the image with --build-arg {BUILD_ARGS[family]}=1 "
            "(docs/deployment.md, 'Docker'), or run a method of a family the image was built for"
        )
    import torch  # only where a model is pretrained: this module stays light for the image's stages

    threads = torch.get_num_threads()
    torch.set_num_threads(PRETRAIN_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def models_of(family: str, everything: bool = False) -> dict[str, Callable[[Path], object]]:
    """The family's embedded models: name -> a function that pretrains (or finds) it in a cache."""
    return importlib.import_module(FAMILY_MODELS[family]).embedded_models(everything)


def prepare(cache_dir: Path, families: Sequence[str], everything: bool = False) -> dict[str, float]:
    """Pretrain (or find) the families' embedded models in ``cache_dir``; seconds each took."""
    took = {}
    for family in families:
        for name, make in models_of(family, everything).items():
            t0 = time.time()
            make(cache_dir)
            took[name] = round(time.time() - t0, 1)
            logging.info("%s ready in %.0f s", name, took[name])
    return took


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.models.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument(
        "--family",
        action="append",
        choices=list(FAMILY_MODELS),
        help="a method family whose embedded models to prepare (repeat it); default: every family",
    )
    p.add_argument("--all", action="store_true", help="also the ablation-only sources")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    took = prepare(args.cache_dir, args.family or list(FAMILY_MODELS), args.all)
    print(f"embedded models in {args.cache_dir}: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
