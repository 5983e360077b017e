"""Pretrain every embedded model into a cache, once: what a Docker image bakes in at build time so
that no container pretrains at run time (a first ``flwr run`` would otherwise wait minutes on
every node, past the server's handshake timeout).

    python -m fedvlm.models.prepare --cache-dir /opt/fedvlm-cache

The embedded tiny CLIP (prompt methods), the tiny VLM (LoRA methods) and the reprogramming sources
(``embedded_resnet.SOURCES``; the label-smoothed ablation source only with ``--all``). Every
recipe is seeded and the cache is keyed by it, so the weights are the ones any machine would
pretrain. This module imports only what pretraining needs (``docker/Dockerfile``'s weights stage
copies exactly those files; ``tests/unit/test_deploy.py`` keeps the two in step).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fedvlm.models import embedded_resnet, tiny_clip, tiny_vlm

ABLATION_ONLY = ("embedded-motif-resnet-ls",)


def prepare(cache_dir: Path, everything: bool = False) -> dict[str, float]:
    """Pretrain (or find) each embedded model in ``cache_dir``; seconds each took."""
    took = {}

    def timed(name: str, make) -> None:
        t0 = time.time()
        make()
        took[name] = round(time.time() - t0, 1)
        logging.info("%s ready in %.0f s", name, took[name])

    timed("embedded-tiny", lambda: tiny_clip.load_embedded_clip(cache_dir))
    timed("embedded-tiny-vlm", lambda: tiny_vlm.ensure_pretrained(cache_dir))
    for name in embedded_resnet.SOURCES:
        if everything or name not in ABLATION_ONLY:
            timed(name, lambda name=name: embedded_resnet.load_pretrained(name, cache_dir))
    return took


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.models.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--all", action="store_true", help="also the ablation-only sources")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    took = prepare(args.cache_dir, args.all)
    print(f"embedded models in {args.cache_dir}: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
