"""VFlash image tasks whose answers cannot be given without looking (issue 25's probes of vision).

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
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import random
from pathlib import Path

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


def quantise(pixels: float) -> int:
    """A pixel coordinate on a SIZE-pixel side → seed 004's 0..1000 grid: the library's one quantiser."""
    return primitives.quantise(pixels, 0, SIZE)


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


def record(rng: random.Random, root: Path, name: str, task: str, disc: bool = True) -> dict:
    cx, cy = centre(rng, task)
    rel = f"images/{name}.png"
    scene(rng, cx, cy, disc).save(root / rel)
    answer = f"<point><{quantise(cx)}><{quantise(cy)}></point>"
    return {"image": rel, "conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": answer}]}


def make(task: str, output: str | Path, train: int, eval_count: int, seed: int = 0,
         blank: bool = False) -> dict[str, Path]:
    """Write the task's train/eval JSONL (disjoint images, one seed) → their paths; `blank`: training
    images without the disc (the eval images keep it)."""
    if task not in TASKS:
        raise ValueError(f"--task={task!r}: one of {', '.join(TASKS)}")
    root = Path(output)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = {}
    for split, count in (("train", train), ("eval", eval_count)):
        rows = [record(rng, root, f"{split}_{i:05d}", task, disc=not (blank and split == "train"))
                for i in range(count)]
        paths[split] = root / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


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
    parser.add_argument("--task", choices=TASKS)
    parser.add_argument("--output")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blank", action="store_true", help="training images without their disc")
    args = parser.parse_args(argv)
    if args.smoke:
        make_smoke_scenes(args.output or SMOKE / "scenes")
        return
    if not (args.task and args.output):
        parser.error("--task and --output are required (or --smoke)")
    for split, path in make(args.task, args.output, args.train, args.eval, args.seed, args.blank).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
