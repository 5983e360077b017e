"""The VLM wrapper: a frozen image-text-to-text model with its adapter, and the batching that
turns (image, prompt, target) triples into model inputs, per-sample losses and generations.
Independent of how the model was loaded (``models.vlm``) or pretrained (``models.tiny_vlm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image


class VLM:
    """A frozen VLM with an adapter, and the batching that turns triples into model inputs."""

    def __init__(self, model, processor, name: str, device: torch.device, max_length: int = 512):
        self.model = model.to(device)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.name = name
        self.device = device
        self.max_length = max_length
        self.model.eval()  # no dropout in the frozen parts; the adapter's own dropout is a config key

    # --- text -------------------------------------------------------------------------------
    def prompt_text(self, prompt: str) -> str:
        if getattr(self.processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
            return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        image_token = getattr(self.processor, "image_token", "<image>")
        return f"{image_token}\n{prompt}"

    def _encode(self, images: list[Image.Image], texts: list[str], padding_side: str) -> dict:
        self.tokenizer.padding_side = padding_side
        batch = self.processor(
            images=[img.convert("RGB") for img in images], text=texts, return_tensors="pt", padding=True
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def training_batch(self, images: list[Image.Image], prompts: list[str], targets: list[str]) -> dict:
        """Inputs with labels on the target tokens (and the end-of-sequence token) only."""
        eos = self.tokenizer.eos_token or ""
        heads = [self.prompt_text(p) for p in prompts]
        full = [h + t + eos for h, t in zip(heads, targets, strict=True)]
        batch = self._encode(images, full, "right")
        head_ids = self._encode(images, heads, "right")
        head_len = head_ids["attention_mask"].sum(dim=1)
        labels = batch["input_ids"].clone()
        positions = torch.arange(labels.shape[1], device=labels.device)[None, :]
        labels[positions < head_len[:, None]] = -100
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch

    def token_logits(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits predicting each next token [B, L-1, V], target ids [B, L-1] with -100 where
        no label)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = self.model(**inputs).logits
        return logits[:, :-1].float(), batch["labels"][:, 1:]

    def losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample loss [B]: each sample's mean over its target tokens, the batch's mean over
        all target tokens): DP-SGD needs the first (a record's loss must not depend on the
        others'), plain fine-tuning minimises the second, from one forward."""
        logits, targets = self.token_logits(batch)
        loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none").sum(dim=1)
        n = (targets != -100).sum(dim=1)
        return loss / n.clamp(min=1), loss.sum() / n.sum().clamp(min=1)

    def per_sample_loss(self, batch: dict) -> torch.Tensor:
        return self.losses(batch)[0]

    @torch.no_grad()
    def generate(self, images: list[Image.Image], prompts: list[str], max_new_tokens: int) -> list[str]:
        batch = self._encode(images, [self.prompt_text(p) for p in prompts], "left")
        out = self.model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
        )
        new = out[:, batch["input_ids"].shape[1] :]
        return [t.strip() for t in self.tokenizer.batch_decode(new, skip_special_tokens=True)]
