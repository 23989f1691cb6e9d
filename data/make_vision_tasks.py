"""VFlash image tasks whose answers cannot be given without looking: issue 25's probes and issue 55's family.

    python data/make_vision_tasks.py --task=clutter --output=/tmp/clutter      # a family task, its own sizes
    python data/make_vision_tasks.py --task=leftright --output=/tmp/lr --train=400 --eval=100 --seed=0
    python data/make_vision_tasks.py --task=locate --output=/tmp/loc --train=2000 --eval=100
    python data/make_vision_tasks.py --smoke      # data/smoke/scenes: `make train`'s scenes and recipes

Each record is a 64×64 light-grey image with one red disc of radius 6 and a few random pixels (so
no two images are equal), the question "Where is the red ball? ..." and a point answer:
- `leftright`: the disc at mid-height, on the left (x = 16 px) or the right (x = 48 px), answers
  `<point><250><500></point>` or `<point><750><500></point>`: one informative token, a coin flip
  for a model that answers from the text;
- `locate`: the disc anywhere (its centre at least its radius from each edge), the answer its centre
  quantised to seed 004's `<0>`..`<1000>` grid;
- `grid`: the disc in one of the nine cells of a 3 × 3 grid, its centre within 1 px of the cell's
  centre: nine places (about 1 in 9 for a model that answers from the text), learnt from scratch in a
  few hundred steps where `locate` takes over a thousand (the smoke run's scenes).

Writes `OUTPUT/train.jsonl`, `OUTPUT/eval.jsonl` and `OUTPUT/images/`; the prompt is the same for every
record, so the text alone says nothing about the answer. `--blank` draws the training images without
their disc (the answers stay): a model trained on them can only learn the text prior, the control of
the image-reliance measurement (its answers must not change with the image).

The family (`FAMILY`, issue 55; `benchmarks/vision_learning.py` trains on each): `locate` made harder in one
way per task, so that a failure names what the model cannot yet see: `small` (radius 2-3 px), `small_224`
(the same in a 224-px image), `backgrounds` (a random colour per image and pixel noise), `distractors`
(other objects of other colours and shapes), `named` (several objects, the question names one), `few` (300
training images), `box` (an ellipse's box, scored by IoU), `motion` (two marks: where the ball will be
next), and `clutter`, the hardest (`HARDEST`): a radius-3 ball on random noisy backgrounds beside a fainter
disc of another colour, 1600 training images, the scene a user reported missed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import posixpath
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from data_pipeline import primitives

SIZE = 64
RADIUS = 6
BACKGROUND = (200, 200, 200)
RED = (220, 30, 30)
QUESTION = ("<image>\nWhere is the red ball? Answer with a point. Tokens <0> to <1000> span the image: "
            "x left to right, y top to bottom.")
TASKS = ("leftright", "locate", "grid")
CELL_CENTRES = (SIZE / 6, SIZE / 2, 5 * SIZE / 6)  # the 3 × 3 grid's cell centres along each side
JITTER = 1.0  # px either way around a cell centre: no two discs at the same place, none off their cell


def quantise(pixels: float, size: int = SIZE) -> int:
    """A pixel coordinate on a `size`-pixel side → seed 004's 0..1000 grid: the library's one quantiser."""
    return primitives.quantise(pixels, 0, size)


def point_answer(x: float, y: float, size: int = SIZE) -> str:
    """Seed 004's point answer for pixel (x, y) of a `size`-pixel square image."""
    return f"<point><{quantise(x, size)}><{quantise(y, size)}></point>"


def centre(rng: random.Random, task: str) -> tuple[float, float]:
    if task == "leftright":
        return (16.0 if rng.random() < 0.5 else 48.0), 32.0
    if task == "grid":
        return tuple(rng.choice(CELL_CENTRES) + rng.uniform(-JITTER, JITTER) for _ in range(2))
    return rng.uniform(RADIUS, SIZE - RADIUS), rng.uniform(RADIUS, SIZE - RADIUS)


def scene(rng: random.Random, cx: float, cy: float, disc: bool = True) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for _ in range(6):  # a few random pixels: no two images equal, no information about the disc
        image.putpixel((rng.randrange(SIZE), rng.randrange(SIZE)), tuple(rng.randrange(256) for _ in range(3)))
    if disc:
        draw.ellipse((cx - RADIUS, cy - RADIUS, cx + RADIUS, cy + RADIUS), fill=RED)
    return image


def draw_record(rng: random.Random, task: str, disc: bool = True) -> tuple[Image.Image, str, str]:
    """One scene of issue 25's `task` → (image, question, answer)."""
    cx, cy = centre(rng, task)
    return scene(rng, cx, cy, disc), QUESTION, point_answer(cx, cy)


def write_splits(output: str | Path, counts: dict[str, int], draw) -> dict[str, Path]:
    """`counts[split]` records of `draw(split)` → (image, question, answer) per split, in order: the images as
    OUTPUT/images/{split}_{i:05d}.png, the records as OUTPUT/{split}.jsonl → those JSONL paths."""
    root = Path(output)
    (root / "images").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in counts.items():
        rows = []
        for i in range(count):
            image, question, answer = draw(split)
            rel = f"images/{split}_{i:05d}.png"
            image.save(root / rel)
            rows.append({"image": rel, "conversations": [{"from": "human", "value": question},
                                                         {"from": "gpt", "value": answer}]})
        paths[split] = root / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def make(task: str, output: str | Path, train: int, eval_count: int, seed: int = 0,
         blank: bool = False) -> dict[str, Path]:
    """Write the task's train/eval JSONL (disjoint images, one seed) → their paths; `blank`: training
    images without the disc (the eval images keep it)."""
    if task not in TASKS:
        raise ValueError(f"--task={task!r}: one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    return write_splits(output, {"train": train, "eval": eval_count},
                        lambda split: draw_record(rng, task, disc=not (blank and split == "train")))


# ---------------------------------------------------------------------------------------------------------
# The task family (issue 55): each task is `locate` made harder in one way, so a failure names its cause.
# Every answer needs the image; the question is the same for every record of a task, except `named`'s,
# where it names one object of several (and so needs both). The family is drawn by `draw_family_record`.

COLOURS = {"red": (220, 30, 30), "blue": (40, 80, 220), "green": (30, 160, 60), "yellow": (225, 200, 30),
           "purple": (150, 60, 190), "orange": (240, 130, 20)}
SHAPES = ("disc", "square", "triangle")
POINT_QUESTION = ("<image>\nWhere is the {name}? Answer with a point. Tokens <0> to <1000> span the image: "
                  "x left to right, y top to bottom.")
BOX_QUESTION = ("<image>\nDetect the red object. Give its box as top-left and bottom-right corners. Tokens <0> "
                "to <1000> span the image: x left to right, y top to bottom.")
MOTION_QUESTION = ("<image>\nThe red ball moved from the grey mark to where it is. If it moves the same again, "
                   "where will it be? Answer with a point. Tokens <0> to <1000> span the image: x left to right, "
                   "y top to bottom.")


@dataclass(frozen=True)
class Task:
    """One task of the family: `locate` (a red disc of radius 6 anywhere on grey, 2000 training images) with
    the fields that differ from it."""

    what: str  # one line: how it is harder than `locate`
    size: int = SIZE
    radius: tuple[float, float] = (RADIUS, RADIUS)
    backgrounds: bool = False  # a random colour per image (never near red) and pixel noise
    distractors: tuple[int, int] = (0, 0)  # other objects: other colours and shapes, never the target's colour
    faint_distractor: bool = False  # a paler disc of another colour beside the target
    named: bool = False  # 3-4 objects of distinct colour and shape; the question names one by colour or shape
    answer: str = "point"  # "point", "box" (the object's box; acc@0.5 IoU) or "motion" (the next position)
    train: int = 2000

    @property
    def metric(self) -> str:
        return "box" if self.answer == "box" else "point"


FAMILY = {
    "small": Task("a disc of radius 2-3 px in 64 px (6 in `locate`)", radius=(2.0, 3.0)),
    "small_224": Task("a disc of radius 2-3 px in 224 px: 1/40 of the side", size=224, radius=(2.0, 3.0)),
    "backgrounds": Task("a background of a random colour per image, with pixel noise", backgrounds=True),
    "distractors": Task("two to four other objects of other colours and shapes", distractors=(2, 4)),
    "named": Task("three or four objects; the question names one by its colour or its shape", named=True),
    "few": Task("300 training images (2000 in `locate`)", train=300),
    "box": Task("a red ellipse of random width and height; the answer is its box (acc@0.5 IoU)",
                radius=(4.0, 14.0), answer="box"),
    "motion": Task("two marks, where the ball was and is; the answer is where it will be", answer="motion"),
    # The user scene, every difficulty at once but the size: the hardest task.
    "clutter": Task("a ball of radius 3 on random backgrounds with noise, a fainter disc of another colour beside "
                    "it, and 1600 training images", radius=(3.0, 3.0), backgrounds=True, faint_distractor=True,
                    train=1600),
}
HARDEST = "clutter"


def _background(rng: random.Random, task: Task) -> tuple[int, int, int]:
    if not task.backgrounds:
        return BACKGROUND
    while True:  # any colour a user's photo may have, but one the red target still stands out from
        colour = tuple(rng.randrange(20, 236) for _ in range(3))
        if sum((a - b) ** 2 for a, b in zip(colour, RED, strict=True)) > 120 ** 2:
            return colour


def _shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "disc":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)


def _free_place(rng: random.Random, taken: list[tuple[float, float, float]], r: float, size: int,
                gap: float = 2.0) -> tuple[float, float]:
    """A centre whose object of radius r stays inside the image and clear of those already placed."""
    for _ in range(1000):
        cx, cy = rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1)
        if all(math.hypot(cx - x, cy - y) > r + s + gap for x, y, s in taken):
            return cx, cy
    raise RuntimeError("make_vision_tasks: no free place left in the image")  # a task spec too crowded to draw


def _noisy(image: Image.Image, rng: random.Random, sigma: float) -> Image.Image:
    pixels = np.asarray(image, np.float32)
    noise = np.random.default_rng(rng.randrange(2 ** 32)).normal(0.0, sigma, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def draw_family_record(rng: random.Random, task: Task) -> tuple[Image.Image, str, str]:
    """One scene of `task` → (image, question, answer)."""
    size = task.size
    image = Image.new("RGB", (size, size), _background(rng, task))
    draw = ImageDraw.Draw(image)
    for _ in range(6):  # a few random pixels, as in every task: no two images equal
        image.putpixel((rng.randrange(size), rng.randrange(size)), tuple(rng.randrange(256) for _ in range(3)))
    r = rng.uniform(*task.radius)  # drawn for every task, so each task's scenes stay the ones measured
    if task.named:
        return _named_scene(rng, task, image, draw)
    if task.answer == "box":
        rx, ry = rng.uniform(*task.radius), rng.uniform(*task.radius)
        cx, cy = rng.uniform(rx + 1, size - rx - 1), rng.uniform(ry + 1, size - ry - 1)
        draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=RED)
        x1, y1, x2, y2 = (quantise(v, size) for v in (cx - rx, cy - ry, cx + rx, cy + ry))
        return image, BOX_QUESTION, f"<ref>red object</ref><objects><box><{x1}><{y1}><{x2}><{y2}></box></objects>"
    if task.answer == "motion":
        # A move of 2r+2 to 2r+8 px in any direction (the marks never touch); the mark where the ball was is a
        # grey disc of the same size.
        while True:
            angle, step = rng.uniform(0, 2 * math.pi), rng.uniform(2 * r + 2, 2 * r + 8)
            dx, dy = step * math.cos(angle), step * math.sin(angle)
            cx, cy = rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1)
            points = [(cx - dx, cy - dy), (cx + dx, cy + dy)]
            if all(r + 1 <= v <= size - r - 1 for point in points for v in point):
                break
        (px, py), (nx, ny) = points
        draw.ellipse((px - r, py - r, px + r, py + r), fill=(110, 110, 110))
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=RED)
        return image, MOTION_QUESTION, point_answer(nx, ny, size)
    cx, cy = _free_place(rng, [], r, size)
    taken = [(cx, cy, r)]
    others = [name for name in COLOURS if name != "red"]
    if task.faint_distractor:  # beside the ball: 2-4 radii from it, half-way between its colour and the background
        background = image.getpixel((0, 0))
        for _ in range(1000):
            angle, gap = rng.uniform(0, 2 * math.pi), rng.uniform(3 * r, 5 * r)
            fx, fy = cx + gap * math.cos(angle), cy + gap * math.sin(angle)
            if r + 1 <= fx <= size - r - 1 and r + 1 <= fy <= size - r - 1:
                break
        colour = COLOURS[rng.choice(others)]
        faint = tuple((a + b) // 2 for a, b in zip(colour, background, strict=True))
        _shape(draw, "disc", fx, fy, r, faint)
    for _ in range(rng.randint(*task.distractors)):
        sr = rng.uniform(*task.radius)
        sx, sy = _free_place(rng, taken, sr, size)
        taken.append((sx, sy, sr))
        _shape(draw, rng.choice(SHAPES), sx, sy, sr, COLOURS[rng.choice(others)])
    _shape(draw, "disc", cx, cy, r, RED)
    if task.backgrounds:
        image = _noisy(image, rng, 12.0)
    return image, POINT_QUESTION.format(name="red ball"), point_answer(cx, cy, size)


def _named_scene(rng: random.Random, task: Task, image: Image.Image, draw: ImageDraw.ImageDraw):
    """3-4 objects of distinct colours (shapes drawn at random); the question names the target by its colour
    and shape, or by its shape alone (half the time) when no other object has that shape."""
    count = rng.randint(3, 4)
    colours = rng.sample(list(COLOURS), count)
    shapes = [rng.choice(SHAPES) for _ in range(count)]
    taken: list[tuple[float, float, float]] = []
    for colour, shape in zip(colours, shapes, strict=True):
        r = rng.uniform(*task.radius)
        cx, cy = _free_place(rng, taken, r, task.size)
        taken.append((cx, cy, r))
        _shape(draw, shape, cx, cy, r, COLOURS[colour])
    target = rng.randrange(count)
    unique_shape = shapes.count(shapes[target]) == 1
    name = shapes[target] if unique_shape and rng.random() < 0.5 else f"{colours[target]} {shapes[target]}"
    cx, cy, _ = taken[target]
    return image, POINT_QUESTION.format(name=name), point_answer(cx, cy, task.size)


def make_family_task(name: str, output: str | Path, eval_count: int = 100, seed: int = 0,
                     train: int | None = None) -> dict[str, Path]:
    """Write family task `name`'s train/eval JSONL and images (one seed; no image shared) → their paths.
    `train`: the number of training records (default the task's own)."""
    if name not in FAMILY:
        raise ValueError(f"--task={name!r}: one of {', '.join(FAMILY)}")
    task = FAMILY[name]
    rng = random.Random(f"{name}/{seed}")
    return write_splits(output, {"train": task.train if train is None else train, "eval": eval_count},
                        lambda split: draw_family_record(rng, task))



SMOKE = Path(__file__).resolve().parent / "smoke"
SMOKE_SCENES = {"task": "grid", "train": 400, "eval": 16, "seed": 0}


def make_smoke_scenes(output: str | Path = SMOKE / "scenes", vflash: str | Path = SMOKE / "vflash") -> None:
    """`make train`'s data (configs/vflash.py's default variant, issue 25): the `grid` task's 400 training
    and 16 held-out scenes in `output`, `recipe.json` = every entry of the smoke recipe `vflash/recipe.json`
    (read from there, re-rooted, so that recipe stays the one home of its entries) plus the scenes, and
    `eval_recipe.json` = the smoke `eval.jsonl` plus the held-out scenes."""
    output, vflash = Path(output), Path(vflash)
    make(SMOKE_SCENES["task"], output, SMOKE_SCENES["train"], SMOKE_SCENES["eval"], SMOKE_SCENES["seed"])
    there = Path(os.path.relpath(os.path.abspath(vflash), os.path.abspath(output))).as_posix()
    recipe = {}
    for name, entry in json.loads((vflash / "recipe.json").read_text()).items():
        files = entry["annotation"]
        entry = {**entry, "root": posixpath.normpath(f"{there}/{entry.get('root', '')}"),
                 "annotation": [f"{there}/{f}" for f in files] if isinstance(files, list) else f"{there}/{files}"}
        recipe[name] = entry
    recipe["smoke_scenes"] = {"annotation": "train.jsonl", "root": ".", "repeat_time": 1.0, "data_augment": False,
                              "length": SMOKE_SCENES["train"]}
    evaluation = {"smoke_eval": {"annotation": f"{there}/eval.jsonl", "root": there},
                  "smoke_scenes_eval": {"annotation": "eval.jsonl", "root": "."}}
    for name, data in (("recipe.json", recipe), ("eval_recipe.json", evaluation)):
        (output / name).write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="write make train's scenes and recipes (make_smoke_scenes) to --output "
                             "(default data/smoke/scenes); the other flags are fixed")
    parser.add_argument("--task", choices=(*TASKS, *FAMILY),
                        help=f"issue 25's {', '.join(TASKS)}, or a task of the family: {', '.join(FAMILY)}")
    parser.add_argument("--output")
    parser.add_argument("--train", type=int, default=None,
                        help="training records (default: 400, or a family task's own count)")
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blank", action="store_true", help="training images without their disc")
    args = parser.parse_args(argv)
    if args.smoke:
        make_smoke_scenes(args.output or SMOKE / "scenes")
        return
    if not (args.task and args.output):
        parser.error("--task and --output are required (or --smoke)")
    if args.task in FAMILY:
        if args.blank:
            parser.error("--blank draws issue 25's tasks only")
        paths = make_family_task(args.task, args.output, args.eval, args.seed, args.train)
    else:
        paths = make(args.task, args.output, 400 if args.train is None else args.train, args.eval, args.seed, args.blank)
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
