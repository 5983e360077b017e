"""The embedded "scenes" domain for the VLM methods: captioning and multiple-choice VQA.

Every image shows one or two coloured shapes of ``data.embedded``'s world (one in the middle,
or one on the left and one on the right). Captions and answers follow from the content, so a
model that sees the image can get them right and one that does not cannot:

- caption: ``a red circle on the left and a blue ring on the right .``; in the varied task each
  record says it one of 16 ways, drawn per record (``phrasings``), as human captions differ from
  image to image: a model can learn the content from any record, but which phrasing a record
  used only from that record, which is what a membership attack needs to find;
- vqa (ScienceQA-style multiple choice, four lettered options): ``question : what color is the
  circle ? options : A blue B red C pink D green . answer :`` -> ``B``. Topics: color, shape,
  count, position (the Dirichlet split is by topic, as the paper splits ScienceQA).

Two corpora of the same world:
- ``pretrain``: attribute tags (``left red circle . right blue ring .``) that the embedded tiny
  VLM is pretrained on, so that its vision tower and language model know the domain the way
  a real VLM knows photos;
- the federated tasks above, whose phrasing and answer format the model has never seen: LoRA
  has something real to learn, and the loss falls from a meaningful start.

A held-out "ood" caption split uses shape pairs never seen together in training (NoCaps-style
out-of-domain evaluation). Everything is generated from seeded numpy, offline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fedvlm.data.embedded import COLORS, IMAGE_SIZE, STYLES, _background, _shape_mask

SCENE_COLORS = tuple(COLORS)
# Four shapes that stay distinct at 32 pixels (a ring and a circle do not, for a tiny ViT).
SHAPES = ("circle", "square", "triangle", "cross")
TOPICS = ("color", "shape", "count", "position")
LETTERS = "ABCD"
COUNT_WORDS = ("one", "two", "three", "four")
SIDES = ("left", "right", "middle")
# Shape pairs that only the out-of-domain split shows (first object, second object).
OOD_PAIRS = frozenset({("cross", "circle"), ("circle", "cross")})


# A lightly textured background: a tiny ViT learns shapes against it within its pretraining
# budget, and the background still varies.
SCENE_STYLE = replace(STYLES["pretrain-cluttered"], texture=0.25)


@dataclass(frozen=True)
class SceneObject:
    color: str
    shape: str
    side: str  # left | right | middle


def render_scene(objects: list[SceneObject], rng: np.random.Generator) -> np.ndarray:
    """A 32x32 uint8 image of the objects on a textured background."""
    st = SCENE_STYLE
    img = _background(rng, st)
    for ob in objects:
        r = rng.uniform(6.0, 7.5) if ob.side != "middle" else rng.uniform(8.5, 11.0)
        cx = {"left": 8.5, "right": 23.5, "middle": 16.0}[ob.side] + rng.uniform(-1.0, 1.0)
        cy = IMAGE_SIZE / 2 + rng.uniform(-3.0, 3.0)
        mask = _shape_mask(ob.shape, cx, cy, r, rng.uniform(-0.3, 0.3))
        color = np.clip(np.array(COLORS[ob.color]) + rng.normal(0, st.color_jitter, 3), 0, 1)
        img[mask] = np.clip(color * rng.uniform(0.85, 1.1), 0, 1)
    img += rng.normal(0, st.pixel_noise, img.shape).astype(np.float32)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)


def draw_objects(rng: np.random.Generator, ood: bool | None = False) -> list[SceneObject]:
    """One object in the middle (a third of scenes) or two side by side, of different shapes.
    ``ood``: True = only the held-out shape pairs, False = never them, None = anything."""
    while True:
        if rng.random() < 1 / 3 and not ood:
            return [
                SceneObject(SCENE_COLORS[rng.integers(len(SCENE_COLORS))], SHAPES[rng.integers(len(SHAPES))], "middle")
            ]
        s1, s2 = (SHAPES[i] for i in rng.choice(len(SHAPES), 2, replace=False))
        if ood is not None and ((s1, s2) in OOD_PAIRS) != bool(ood):
            continue
        c1, c2 = (SCENE_COLORS[i] for i in rng.choice(len(SCENE_COLORS), 2, replace=True))
        return [SceneObject(c1, s1, "left"), SceneObject(c2, s2, "right")]


def caption(objects: list[SceneObject]) -> str:
    if len(objects) == 1:
        ob = objects[0]
        return f"a {ob.color} {ob.shape} in the middle ."
    a, b = objects
    return f"a {a.color} {a.shape} on the left and a {b.color} {b.shape} on the right ."


def phrasings(objects: list[SceneObject]) -> list[str]:
    """Every way the varied caption task may say the same scene (16 for two objects, 8 for one),
    from the words the domain already has: which side first, object or place first, an opening
    "there is", the article "a" or "one". The first is ``caption``'s."""
    out = []
    for opening in ("", "there is "):
        for article in ("a", "one"):
            for place_first in (False, True):
                said = []
                for ob in objects:
                    where = "in the middle" if ob.side == "middle" else f"on the {ob.side}"
                    thing = f"{article} {ob.color} {ob.shape}"
                    said.append(f"{where} {thing}" if place_first else f"{thing} {where}")
                orders = [said] if len(said) == 1 else [said, said[::-1]]
                out += [f"{opening}{' and '.join(o)} ." for o in orders]
    return out


def tags(objects: list[SceneObject]) -> str:
    """The pretraining text: attributes only, no sentence structure."""
    return " and ".join(f"{ob.side} {ob.color} {ob.shape}" for ob in objects) + " ."


def _options(correct: str, pool: tuple[str, ...], rng: np.random.Generator) -> tuple[list[str], int]:
    others = [p for p in pool if p != correct]
    picks = [others[i] for i in rng.choice(len(others), 3, replace=False)]
    pos = int(rng.integers(4))
    return picks[:pos] + [correct] + picks[pos:], pos


def question(objects: list[SceneObject], topic: str, rng: np.random.Generator) -> tuple[str, list[str], int]:
    """(question, four options, index of the right one) about the scene, on ``topic``."""
    ob = objects[int(rng.integers(len(objects)))]
    if topic == "color":
        q, right, pool = f"what color is the {ob.shape} ?", ob.color, SCENE_COLORS
    elif topic == "shape":
        where = "in the middle" if ob.side == "middle" else f"on the {ob.side}"
        q, right, pool = f"what shape is {where} ?", ob.shape, SHAPES
    elif topic == "count":
        q, right, pool = "how many objects are there ?", COUNT_WORDS[len(objects) - 1], COUNT_WORDS
    elif topic == "position":
        q, right, pool = f"where is the {ob.color} {ob.shape} ?", ob.side, SIDES + ("top",)
    else:
        raise ValueError(f"unknown topic {topic!r}; known: {TOPICS}")
    options, idx = _options(right, pool, rng)
    return q, options, idx


def vqa_prompt(q: str, options: list[str]) -> str:
    opts = " ".join(f"{LETTERS[i]} {o}" for i, o in enumerate(options))
    return f"question : {q} options : {opts} . answer :"


CAPTION_PROMPT = "describe the image ."
PRETRAIN_PROMPT = "list the objects ."


@dataclass
class SceneCorpus:
    images: np.ndarray  # uint8 [N, 32, 32, 3]
    prompts: list[str]
    targets: list[str]
    labels: np.ndarray  # topic (vqa) or the first object's shape (caption): the split label
    references: list[list[str]]


def generate(task: str, n: int, seed: int, ood: bool = False) -> SceneCorpus:
    """``n`` samples of ``task`` ('caption', 'caption-varied', 'vqa' or 'pretrain')."""
    rng = np.random.default_rng(seed)
    images, prompts, targets, labels, refs = [], [], [], [], []
    for i in range(n):
        objects = draw_objects(rng, ood=ood if task.startswith("caption") else None)
        images.append(render_scene(objects, rng))
        if task in ("caption", "caption-varied"):
            text = caption(objects)
            if task == "caption-varied":  # own stream per record: the images stay those of 'caption'
                ways = phrasings(objects)
                text = ways[int(np.random.default_rng([seed, i, 1]).integers(len(ways)))]
            prompts.append(CAPTION_PROMPT)
            targets.append(text)
            refs.append(phrasings(objects) if task == "caption-varied" else [text])
            labels.append(SHAPES.index(objects[0].shape))
        elif task == "vqa":
            topic = TOPICS[i % len(TOPICS)]
            q, options, idx = question(objects, topic, rng)
            prompts.append(vqa_prompt(q, options))
            targets.append(LETTERS[idx])
            refs.append([LETTERS[idx]])
            labels.append(TOPICS.index(topic))
        elif task == "pretrain":
            # the pretraining corpus mixes tags with plain questions answered by one word,
            # so the model learns to read a question and look, not the answer format
            if rng.random() < 0.5:
                prompts.append(PRETRAIN_PROMPT)
                targets.append(tags(objects))
            else:
                topic = TOPICS[int(rng.integers(len(TOPICS)))]
                q, options, idx = question(objects, topic, rng)
                prompts.append(q)
                targets.append(options[idx])
            refs.append([targets[-1]])
            labels.append(0)
        else:
            raise ValueError(f"unknown scenes task {task!r}; known: caption, caption-varied, vqa, pretrain")
    return SceneCorpus(np.stack(images), prompts, targets, np.asarray(labels, dtype=np.int64), refs)


def vocabulary() -> list[str]:
    """Every word the domain's texts use (the embedded tokenizer's training corpus adds the
    generated texts themselves; this list guarantees no word is ever unknown)."""
    words = set(SCENE_COLORS) | set(SHAPES) | set(COUNT_WORDS) | set(SIDES) | set(LETTERS) | {"top"}
    for text in (
        CAPTION_PROMPT,
        PRETRAIN_PROMPT,
        "a on the and in the middle .",
        "question : options : answer :",
        "what color is the ? what shape is where is the how many objects are there ?",
    ):
        words.update(text.split())
    return sorted(words)


def domain_version() -> str:
    """A hash of this module's source: any change to the scenes, texts or questions
    invalidates what was pretrained on them."""
    import hashlib
    import inspect
    import sys

    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:10]
