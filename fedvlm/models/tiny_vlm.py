"""The embedded tiny VLM: a LLaVA-architecture model small enough to pretrain on a CPU.

Built from config (transformers' ``LlavaForConditionalGeneration``: a CLIP vision tower, a
two-layer projector and a Llama language model), with a word-level tokenizer trained here on
the scenes domain's texts, and pretrained on the domain's attribute tags and one-word
answers (``data.scenes``). The result is saved with ``save_pretrained`` (model and
``LlavaProcessor``) and loaded through exactly the same code as a hub checkpoint, so the
federated code never special-cases it.

Pretraining is seeded and cached under ``<cache-dir>/models/``, keyed by the recipe and the
domain version; a file lock makes concurrent first uses train it once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedvlm.data import scenes
from fedvlm.data.embedded import IMAGE_SIZE, domain_version
from fedvlm.models.prepare import pretraining
from fedvlm.utils.files import file_lock
from fedvlm.utils.progress import each

log = logging.getLogger(__name__)

EMBEDDED_VLM_NAME = "embedded-tiny-vlm"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<image>")
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)
# A minimal chat template: "<image> prompt " then the answer; the assistant turn ends with </s>.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}"
    "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class VLMRecipe:
    seed: int = 0
    samples: int = 6000
    steps: int = 1200
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    patch_size: int = 8
    vision_width: int = 96
    vision_layers: int = 3
    text_width: int = 128
    text_layers: int = 4
    heads: int = 4
    version: int = 1

    def key(self) -> str:
        # the corpus comes from data.scenes (and data.embedded's drawing code): their versions key it
        blob = json.dumps(
            {**asdict(self), "domain": domain_version(), "scenes": scenes.domain_version()}, sort_keys=True
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def build_processor(recipe: VLMRecipe, corpus: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    tok.train_from_iterator([" ".join(scenes.vocabulary())] + corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=list(MEAN),
        image_std=list(STD),
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=fast,
        patch_size=recipe.patch_size,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )


def build_model(recipe: VLMRecipe, tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=recipe.vision_width,
        intermediate_size=2 * recipe.vision_width,
        num_hidden_layers=recipe.vision_layers,
        num_attention_heads=recipe.heads,
        image_size=IMAGE_SIZE,
        patch_size=recipe.patch_size,
        projection_dim=recipe.vision_width,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.text_width,
        intermediate_size=2 * recipe.text_width,
        num_hidden_layers=recipe.text_layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.heads,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(recipe.seed)
    return LlavaForConditionalGeneration(config)


def pretrain(recipe: VLMRecipe, out_dir: Path) -> None:
    """Pretrain every weight on the domain's tags and one-word answers; save model + processor."""
    from fedvlm.models.vlm_batching import VLM

    t0 = time.time()
    corpus = scenes.generate("pretrain", recipe.samples, seed=30_000 + recipe.seed)
    # the tokenizer also sees the federated tasks' words (a real tokenizer knows them all)
    vocab_texts = (
        corpus.targets
        + corpus.prompts
        + scenes.generate("caption", 50, 1).targets
        + scenes.generate("vqa", 50, 1).prompts
    )
    processor = build_processor(recipe, vocab_texts)
    model = build_model(recipe, processor.tokenizer)
    vlm = VLM(model, processor, "embedded", torch.device("cpu"))
    images = [Image.fromarray(x) for x in corpus.images]
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.steps, pct_start=0.1)
    rng = np.random.default_rng(recipe.seed)
    model.train()
    for step in each(range(recipe.steps), "pretraining the tiny VLM"):
        idx = rng.choice(len(images), size=recipe.batch_size, replace=False)
        batch = vlm.training_batch(
            [images[i] for i in idx], [corpus.prompts[i] for i in idx], [corpus.targets[i] for i in idx]
        )
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            log.info(
                "tiny VLM pretraining: step %d/%d, loss %.3f (%.0fs)",
                step + 1,
                recipe.steps,
                loss.item(),
                time.time() - t0,
            )
    model.eval()
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    (out_dir / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    log.info("tiny VLM pretrained in %.1fs", time.time() - t0)


def _pretrain_into(recipe: VLMRecipe, path: Path) -> None:
    """Pretrain into a temporary sibling, then move it to ``path``: a reader never sees half a model."""
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        pretrain(recipe, tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_pretrained(cache_dir: Path, recipe: VLMRecipe = VLMRecipe()) -> Path:
    """The directory of the pretrained embedded VLM, pretraining it on first use."""
    path = Path(cache_dir) / "models" / f"{EMBEDDED_VLM_NAME}-{recipe.key()}"
    if not (path / "recipe.json").exists():
        with file_lock(path):
            if not (path / "recipe.json").exists():
                with pretraining("vlm", EMBEDDED_VLM_NAME):
                    log.info("pretraining the embedded tiny VLM once (cached at %s)", path)
                    _pretrain_into(recipe, path)
    return path


def embedded_models(everything: bool = False) -> dict[str, Callable[[Path], object]]:
    """The VLM family's embedded models, for ``models.prepare``."""
    return {EMBEDDED_VLM_NAME: ensure_pretrained}
