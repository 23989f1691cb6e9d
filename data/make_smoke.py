"""Write the deterministic synthetic smoke data sets under `data/smoke/`.

Run from the repository root (re-running gives byte-identical files):

    .venv/bin/python data/make_smoke.py                 # writes data/smoke/
    .venv/bin/python data/make_smoke.py --out /tmp/smoke

Layout written under `--out` (default `data/smoke`):

* `vflash/` (seed 004, "VFlash Data Preparation"): Pillow-drawn 128x128 PNG scenes in
  `images/`, one short mp4 in `videos/`, the annotation files `points.jsonl`, `boxes.jsonl`,
  `robot2d.jsonl`, `robot3d.jsonl`, `drive.jsonl` (the training set, 96 rows), the held-out
  `eval.jsonl` (16 rows, scenes not used in training) and `recipe.json`, whose `root` is "."
  (media paths are relative to the recipe's folder; annotation paths are too).
* `valen/` (seed 000, "Data format"): `train.jsonl` (6 records, 15 questions, 13 labeled),
  `text.jsonl` (its text-only records, byte-identical lines), the held-out `eval.jsonl` (4 text records
  of other group_ids, configs/valen.py's eval set) and `assets/` (one PNG, one mp4).

Geometry conventions of the synthetic scenes (what the labels are computed from):

* Pixel coordinates are continuous, with the image spanning [0, W] x [0, H]; an object drawn on
  pixel columns l..r-1 and rows t..b-1 has the box (l, t, r, b) and the centre ((l+r)/2, (t+b)/2).
* Image coordinates are quantised as `quantise(x, 0, W)` / `quantise(y, 0, H)`: linear to
  0..1000 with half-up rounding, e.g. x = 8 px of 128 -> 62.5 -> <63>. `quantise` is the library's
  (`data_pipeline.primitives`), so the labels round every written half (-4.995 m) the way training
  and evaluation read them back; `round_half_up` here only places drawn pixels.
* Robot 3D points are in the camera frame (x right, y down, z forward, metres) and drawn with a
  pinhole camera (f = 80 px, principal point at the image centre); x and y are quantised over
  [-5, 5] m and z over [0, 10] m. Driving waypoints are in the ego frame (x forward over
  [-10, 250] m, y left over [-65, 65] m, heading over [-pi, pi]).

Every random choice comes from `random.Random` instances with fixed seeds; PNGs are written by
Pillow (no timestamps) and mp4s by PyAV with the `bitexact` flags and one encoder thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
from collections.abc import Callable, Iterable
from fractions import Fraction
from pathlib import Path

from PIL import Image, ImageDraw

from data_pipeline.primitives import ATOMIC_DECODING, RANGES, quantise

IMAGE_SIZE = 128
VALEN_VIDEO_SIZE = 64
FOCAL_PX = 80.0

ROBOT3D_RANGE = RANGES["robot_single"]  # seed 004's camera-frame ranges, from the library's table
DRIVE_RANGE = RANGES["drive"]

BACKGROUNDS = [(245, 245, 240), (232, 232, 232), (240, 232, 214), (226, 236, 242)]
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 170),
    "orange": (240, 130, 30),
}
CATEGORIES = ("cup", "ball", "box", "block")
ABSENT_CATEGORIES = ("dog", "cat", "bottle", "plate")
GRIPPER_COLOUR = (25, 25, 25)
PATH_COLOUR = (90, 90, 90)


# --------------------------------------------------------------------------- quantiser


def round_half_up(x: float | int | Fraction) -> int:
    """Round to the nearest integer, ties upward (0.5 -> 1, 2.5 -> 3, -0.5 -> 0), exactly."""
    return math.floor(Fraction(x) + Fraction(1, 2))


def num(k: int) -> str:
    return f"<{k}>"


def tool_call(block_size: int, count: int | None = None) -> str:
    args: dict[str, int] = {"block_size": block_size}
    if count is not None:
        args["count"] = count
    body = json.dumps({"name": ATOMIC_DECODING, "arguments": args}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


# --------------------------------------------------------------------------- drawing


class Obj:
    """One drawn object with its pixel box [l, r) x [t, b)."""

    def __init__(self, category: str, colour: str, left: int, top: int, right: int, bottom: int):
        self.category, self.colour = category, colour
        self.l, self.t, self.r, self.b = left, top, right, bottom

    @property
    def name(self) -> str:
        return f"{self.colour} {self.category}"

    @property
    def centre(self) -> tuple[float, float]:
        return (self.l + self.r) / 2, (self.t + self.b) / 2

    def qbox(self, size: int = IMAGE_SIZE) -> tuple[int, int, int, int]:
        return (quantise(self.l, 0, size), quantise(self.t, 0, size),
                quantise(self.r, 0, size), quantise(self.b, 0, size))

    def qcentre(self, size: int = IMAGE_SIZE) -> tuple[int, int]:
        cx, cy = self.centre
        return quantise(cx, 0, size), quantise(cy, 0, size)


def object_size(rng: random.Random, category: str) -> tuple[int, int]:
    if category == "ball":
        d = rng.randint(14, 24)
        return d, d
    if category == "cup":
        return rng.randint(12, 18), rng.randint(18, 26)
    if category == "box":
        return rng.randint(18, 26), rng.randint(18, 26)
    return rng.randint(24, 32), rng.randint(10, 14)  # block: wide and flat


def draw_object(draw: ImageDraw.ImageDraw, obj: Obj) -> None:
    fill = COLOURS[obj.colour]
    dark = tuple(c // 2 for c in fill)
    x0, y0, x1, y1 = obj.l, obj.t, obj.r - 1, obj.b - 1  # Pillow boxes are inclusive
    if obj.category == "ball":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif obj.category == "cup":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
        draw.rectangle([x0, y0, x1, y0 + 2], fill=dark)  # rim
    elif obj.category == "box":
        draw.rectangle([x0, y0, x1, y1], fill=fill, outline=dark)
        draw.line([x0, (y0 + y1) // 2, x1, (y0 + y1) // 2], fill=dark)  # tape
    else:
        draw.rectangle([x0, y0, x1, y1], fill=fill)


def draw_gripper(draw: ImageDraw.ImageDraw, x: float, y: float) -> None:
    """A black gripper marker (two fingers pointing down, joined at the top) centred at (x, y)."""
    xi, yi = round_half_up(x), round_half_up(y)
    draw.rectangle([xi - 6, yi - 6, xi - 4, yi + 3], fill=GRIPPER_COLOUR)
    draw.rectangle([xi + 4, yi - 6, xi + 6, yi + 3], fill=GRIPPER_COLOUR)
    draw.rectangle([xi - 6, yi - 8, xi + 6, yi - 6], fill=GRIPPER_COLOUR)


def cell_bounds(cell: int, size: int = IMAGE_SIZE, grid: int = 3) -> tuple[int, int, int, int]:
    edges = [round(size * k / grid) for k in range(grid + 1)]
    row, col = divmod(cell, grid)
    return edges[col], edges[row], edges[col + 1], edges[row + 1]


def place_in_cell(rng: random.Random, cell: int, w: int, h: int, margin: int = 2) -> tuple[int, int, int, int]:
    cl, ct, cr, cb = cell_bounds(cell)
    left = rng.randint(cl + margin, cr - margin - w)
    top = rng.randint(ct + margin, cb - margin - h)
    return left, top, left + w, top + h


def random_objects(rng: random.Random, cells: list[int], kinds: list[tuple[str, str]]) -> list[Obj]:
    objs = []
    for cell, (category, colour) in zip(cells, kinds, strict=True):
        w, h = object_size(rng, category)
        objs.append(Obj(category, colour, *place_in_cell(rng, cell, w, h)))
    return objs


def new_canvas(rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    return Image.new("RGB", (size, size), rng.choice(BACKGROUNDS))


def save_png(image: Image.Image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")


def write_mp4(frames: list[Image.Image], path: Path, fps: int = 8) -> None:
    """Encode RGB frames to a byte-deterministic mp4 (mpeg4, bitexact, one thread)."""
    import av  # local import: only the video writers need PyAV

    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = frames[0].size
    with av.open(str(path), "w", format="mp4", container_options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        stream.codec_context.options = {"flags": "+bitexact", "qscale": "3", "g": str(fps)}
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_image(image.convert("RGB"))
            frame.pts = index
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def write_jsonl(path: Path, rows: Iterable[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(lines)
    return len(lines)


def write_json(path: Path, data: object) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def human(text: str) -> dict:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict:
    return {"from": "gpt", "value": text}


def check_prompt(text: str, max_words: int = 40) -> str:
    words = len(text.replace("<image>", " ").split())  # placeholders are not words
    assert words <= max_words, f"prompt has {words} words: {text!r}"
    return text


# --------------------------------------------------------------------------- VFlash rows

# Paraphrases (chosen by the row's rng) so the prompts are not one fixed string per kind; every
# variant states the coordinate convention, as the seed's prompts do.
IMAGE_SPANS = (
    "Tokens <0> to <1000> span the image, x left to right and y top to bottom.",
    "Coordinates run from <0> to <1000> across the image width (x) and height (y).",
    "Use tokens <0> to <1000>: x from the left edge, y from the top edge.",
)
POINT_PROMPTS = (
    "Point to the {o}. Answer with a point at its centre.",
    "Where is the {o}? Mark its centre with a point.",
    "Locate the {o} and give the point in the middle of it.",
    "Show me the centre of the {o} as a point.",
)
BOX_FIRST_PROMPTS = (
    "Detect every {c}. Give one box per object, left to right, as top-left and bottom-right corners.",
    "Find all objects of category {c}. List a box for each, left to right (top-left, bottom-right).",
    "Outline each {c} with a bounding box, ordered left to right by the top-left corner.",
)
BOX_NEXT_PROMPTS = ("Now detect every {c}.", "And every {c}?", "What about the category {c}?", "Next: {c}.")
ROBOT_TASKS = (  # (task in the prompt, sub-task stated in <action>)
    ("pick up the {o}", "Move the gripper to the {o}."),
    ("grasp the {o}", "Reach for the {o}."),
    ("touch the {o}", "Approach the {o}."),
    ("tap the {o}", "Lower the gripper onto the {o}."),
)
DRIVE_PROMPTS = (
    "Predict the ego vehicle's next {p} waypoints over {s} seconds.",
    "Plan the next {s} seconds of driving as {p} waypoints.",
    "Give the car's {p} waypoints for the next {s} seconds.",
)


class VFlashWriter:
    """Draws scenes into `root/images` and builds rows with media references relative to `root`."""

    def __init__(self, root: Path):
        self.root = root

    def save(self, image: Image.Image, name: str) -> str:
        rel = f"images/{name}.png"
        save_png(image, self.root / rel)
        return rel

    @staticmethod
    def media(rels: list[str], form: str) -> object:
        """The `image` field in one of the seed's forms: path, list of paths or `{"file": ...}`."""
        if form == "path":
            assert len(rels) == 1
            return rels[0]
        if form == "list":
            return list(rels)
        if form == "dict":
            assert len(rels) == 1
            return {"file": rels[0], "resize": [96, 96]}
        raise ValueError(form)

    # -- points ------------------------------------------------------------------------

    def point_row(self, rng: random.Random, name: str, form: str) -> dict:
        image = new_canvas(rng)
        draw = ImageDraw.Draw(image)
        n = rng.randint(2, 4)
        kinds = rng.sample([(c, k) for c in CATEGORIES for k in COLOURS], n)  # distinct colour+category
        objs = random_objects(rng, rng.sample(range(9), n), kinds)
        for obj in objs:
            draw_object(draw, obj)
        target = rng.choice(objs)
        qx, qy = target.qcentre()
        prompt = check_prompt(
            f"<image>\n{rng.choice(POINT_PROMPTS).format(o=target.name)} {rng.choice(IMAGE_SPANS)}"
        )
        answer = f"<point>{num(qx)}{num(qy)}</point>"
        return {"image": self.media([self.save(image, name)], form),
                "conversations": [human(prompt), gpt(answer)]}

    # -- boxes -------------------------------------------------------------------------

    def box_row(self, rng: random.Random, name: str, form: str, with_absent: bool) -> dict:
        image = new_canvas(rng)
        draw = ImageDraw.Draw(image)
        n = rng.randint(2, 5)
        present = rng.sample(CATEGORIES, rng.randint(1, min(3, n)))
        cats = present + [rng.choice(present) for _ in range(n - len(present))]  # repeats -> several boxes
        kinds = [(c, rng.choice(list(COLOURS))) for c in cats]
        objs = random_objects(rng, rng.sample(range(9), n), kinds)
        for obj in objs:
            draw_object(draw, obj)
        asked = rng.sample(present, rng.randint(1, min(2, len(present))))
        if with_absent:
            missing = [c for c in CATEGORIES if c not in present] + list(ABSENT_CATEGORIES)
            asked.insert(rng.randint(0, len(asked)), rng.choice(missing))
        conversations = []
        for turn, category in enumerate(asked):
            if turn == 0:
                text = f"<image>\n{rng.choice(BOX_FIRST_PROMPTS).format(c=category)} {rng.choice(IMAGE_SPANS)}"
            else:
                text = rng.choice(BOX_NEXT_PROMPTS).format(c=category)
            conversations.append(human(check_prompt(text)))
            boxes = sorted(o.qbox() for o in objs if o.category == category)
            if boxes:
                for x1, y1, x2, y2 in boxes:
                    assert x1 < x2 and y1 < y2
                inner = "".join(f"<box>{num(x1)}{num(y1)}{num(x2)}{num(y2)}</box>" for x1, y1, x2, y2 in boxes)
            else:
                inner = "None"
            conversations.append(gpt(f"<ref>{category}</ref><objects>{inner}</objects>"))
        return {"image": self.media([self.save(image, name)], form), "conversations": conversations}

    # -- robot 2D ----------------------------------------------------------------------

    @staticmethod
    def _robot_scene(rng: random.Random) -> tuple[list[Obj], Obj, tuple[float, float]]:
        n = rng.randint(2, 3)
        cells = rng.sample(range(9), n + 1)
        kinds = rng.sample([(c, k) for c in CATEGORIES for k in COLOURS], n)
        objs = random_objects(rng, cells[:n], kinds)
        gl, gt, gr, gb = cell_bounds(cells[n])
        start = (rng.randint(gl + 8, gr - 8), rng.randint(gt + 10, gb - 6))
        return objs, rng.choice(objs), start

    @staticmethod
    def _curve(start: tuple[float, float], end: tuple[float, float], bend: float, p: int) -> list[tuple[float, float]]:
        """P waypoints after `start` on a quadratic Bezier curve ending at `end`."""
        (x0, y0), (x2, y2) = start, end
        mx, my = (x0 + x2) / 2, (y0 + y2) / 2
        dx, dy = x2 - x0, y2 - y0
        x1, y1 = mx - bend * dy, my + bend * dx
        points = []
        for i in range(1, p + 1):
            s = i / p
            points.append(((1 - s) ** 2 * x0 + 2 * (1 - s) * s * x1 + s**2 * x2,
                           (1 - s) ** 2 * y0 + 2 * (1 - s) * s * y1 + s**2 * y2))
        return points

    @staticmethod
    def _draw_robot2d(rng_bg: tuple[int, int, int], objs: list[Obj], gripper: tuple[float, float],
                      path: list[tuple[float, float]] | None) -> Image.Image:
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rng_bg)
        draw = ImageDraw.Draw(image)
        for obj in objs:
            draw_object(draw, obj)
        if path:
            draw.line([gripper, *path], fill=PATH_COLOUR, width=1)
            for x, y in path:
                draw.ellipse([x - 1.5, y - 1.5, x + 1.5, y + 1.5], fill=PATH_COLOUR)
        draw_gripper(draw, *gripper)
        return image

    def robot2d_row(self, rng: random.Random, name: str, form: str, mask: bool, two_views: bool) -> dict:
        background = rng.choice(BACKGROUNDS)
        objs, target, start = self._robot_scene(rng)
        p = rng.randint(4, 8)
        path = self._curve(start, target.centre, rng.uniform(-0.25, 0.25), p)
        rels = []
        if two_views:  # previous view: the gripper a few pixels back along the same direction
            tx, ty = target.centre
            prev = (start[0] - (tx - start[0]) * 0.15, start[1] - (ty - start[1]) * 0.15)
            rels.append(self.save(self._draw_robot2d(background, objs, prev, None), f"{name}_prev"))
        rels.append(self.save(self._draw_robot2d(background, objs, start, path), name))
        task, action = (t.format(o=target.name) for t in rng.choice(ROBOT_TASKS))
        lead = "<image>\n<image>\nPrevious and current views." if two_views else "<image>\n"
        prompt = self._robot2d_prompt(lead, task, p)
        return self._robot2d_answer(rng, action, path, p, prompt,
                                    self.media(rels, "list" if two_views else form), mask)

    @staticmethod
    def _robot2d_prompt(lead: str, task: str, p: int) -> str:
        return check_prompt(
            f"{lead} The robot is doing \"{task}\". Predict the next {p} gripper waypoints in the image. "
            f"Tokens <0> to <1000> span the image: u left to right, v top to bottom.".replace("\n ", "\n")
        )

    def _robot2d_answer(self, rng: random.Random, action: str, path: list[tuple[float, float]], p: int,
                        prompt: str, media: object, mask: bool) -> dict:
        coords = "".join(num(quantise(x, 0, IMAGE_SIZE)) + num(quantise(y, 0, IMAGE_SIZE)) for x, y in path)
        answer = (f"<action>{action}</action>"
                  f"{tool_call(2 * p + 2, p)}<robot_single_2d>{coords}</robot>")
        row = {"image": media, "conversations": [human(prompt), gpt(answer)]}
        if mask:  # one waypoint "occluded": its two coordinate tokens leave the loss
            hidden = rng.randrange(p)
            row["atom_loss_masks"] = ["".join("0" if i // 2 == hidden else "1" for i in range(2 * p))]
        return row

    def robot2d_video_row(self, rng: random.Random, name: str) -> dict:
        """A row whose observation is one decoded frame of a short mp4 (`frame_index` form)."""
        background = rng.choice(BACKGROUNDS)
        objs, target, start = self._robot_scene(rng)
        frames_total, current = 8, 3
        track = [start, *self._curve(start, target.centre, 0.0, frames_total - 1)]
        frames = [self._draw_robot2d(background, objs, track[i], None) for i in range(frames_total)]
        rel = f"videos/{name}.mp4"
        write_mp4(frames, self.root / rel)
        path = track[current + 1:]
        p = len(path)
        task, action = (t.format(o=target.name) for t in rng.choice(ROBOT_TASKS))
        prompt = self._robot2d_prompt("<image>\n", task, p)
        return self._robot2d_answer(rng, action, path, p, prompt, [{"video": rel, "frame_index": current}], False)

    # -- robot 3D ----------------------------------------------------------------------

    @staticmethod
    def project(x: float, y: float, z: float) -> tuple[float, float]:
        c = IMAGE_SIZE / 2
        return c + FOCAL_PX * x / z, c + FOCAL_PX * y / z

    def robot3d_row(self, rng: random.Random, name: str, form: str, mask: bool, with_count: bool) -> dict:
        image = new_canvas(rng)
        draw = ImageDraw.Draw(image)
        goal = (rng.uniform(-1.2, 1.2), rng.uniform(0.1, 0.8), rng.uniform(3.0, 6.0))
        start = (rng.uniform(-1.2, 1.2), rng.uniform(-0.6, -0.1), rng.uniform(2.5, 5.0))
        category, colour = rng.choice(CATEGORIES), rng.choice(list(COLOURS))
        # distractor first, then the target object at the projection of the goal, scaled by depth
        other = (rng.choice(CATEGORIES), rng.choice([k for k in COLOURS if k != colour]))
        objs = []
        for (cat, col), (gx, gy, gz) in (
            (other, (goal[0] + (1.5 if goal[0] < 0 else -1.5), goal[1], goal[2] + rng.uniform(-0.5, 0.5))),
            ((category, colour), goal),
        ):
            u, v = self.project(gx, gy, gz)
            w, h = object_size(rng, cat)
            w, h = max(8, round(w * 3.5 / gz)), max(8, round(h * 3.5 / gz))
            left, top = round_half_up(u - w / 2), round_half_up(v - h / 2)
            objs.append(Obj(cat, col, left, top, left + w, top + h))
        for obj in objs:
            draw_object(draw, obj)
        draw_gripper(draw, *self.project(*start))
        p = rng.choice([6, 8, 10])
        lift = rng.uniform(0.2, 0.5)
        waypoints = []
        for i in range(1, p + 1):
            s = i / p
            x = start[0] + (goal[0] - start[0]) * s
            y = start[1] + (goal[1] - start[1]) * s - lift * math.sin(math.pi * s)  # arc upward (-y)
            z = start[2] + (goal[2] - start[2]) * s
            waypoints.append((x, y, z))
        coords = ""
        for point in waypoints:
            for value, (lo, hi) in zip(point, ROBOT3D_RANGE, strict=True):
                assert lo <= value <= hi
                coords += num(quantise(value, lo, hi))
        task, action = (t.format(o=f"{colour} {category}") for t in rng.choice(ROBOT_TASKS))
        prompt = check_prompt(
            f"<image>\nRobot task: \"{task}\". Predict {p} gripper waypoints in the camera frame (meters; "
            f"x right, y down, z forward). Tokens <0> to <1000> map x, y from -5 to 5 and z from 0 to 10."
        )
        answer = (f"<action>{action}</action>"
                  f"{tool_call(3 * p + 2, p if with_count else None)}<robot_single>{coords}</robot>")
        row = {"image": self.media([self.save(image, name)], form),
               "conversations": [human(prompt), gpt(answer)]}
        if mask:
            hidden = rng.randrange(p)
            row["atom_loss_masks"] = ["".join("0" if i // 3 == hidden else "1" for i in range(3 * p))]
        return row

    # -- driving -----------------------------------------------------------------------

    def drive_row(self, rng: random.Random, name: str, form: str, with_count: bool) -> dict:
        speed = rng.uniform(3.0, 15.0)
        curvature = rng.choice([-1, 1]) * rng.uniform(0.0, 0.03)
        p, dt = 8, 0.5
        waypoints = []
        for i in range(1, p + 1):
            arc = speed * dt * i
            heading = curvature * arc
            if abs(curvature) < 1e-9:
                x, y = arc, 0.0
            else:
                x, y = math.sin(heading) / curvature, (1 - math.cos(heading)) / curvature
            waypoints.append((x, y, heading))
        image = self._road_image(rng, curvature, speed)
        coords = ""
        for point in waypoints:
            for value, (lo, hi) in zip(point, DRIVE_RANGE, strict=True):
                assert lo <= value <= hi
                coords += num(quantise(value, lo, hi))
        prompt = check_prompt(
            f"<image>\n{rng.choice(DRIVE_PROMPTS).format(p=p, s=f'{p * dt:g}')} Ego frame: x forward, "
            f"y left, meters; heading in radians. Tokens <0> to <1000> map x from -10 to 250, y from -65 to 65, "
            f"heading from -pi to pi."
        )
        answer = f"{tool_call(3 * p + 2, p if with_count else None)}<drive>{coords}</drive>"
        return {"image": self.media([self.save(image, name)], form),
                "conversations": [human(prompt), gpt(answer)]}

    @staticmethod
    def _road_image(rng: random.Random, curvature: float, speed: float) -> Image.Image:
        size = IMAGE_SIZE
        horizon = 48
        image = Image.new("RGB", (size, size), (150, 190, 230))
        draw = ImageDraw.Draw(image)
        draw.rectangle([0, horizon, size - 1, size - 1], fill=rng.choice([(96, 140, 80), (170, 150, 110)]))
        # road: rows from the bottom to the horizon; its centre drifts left for positive (left) curvature
        bend = -curvature * 900
        for row in range(horizon, size):
            depth = (row - horizon) / (size - horizon)  # 0 at the horizon, 1 at the bottom
            centre = size / 2 + bend * (1 - depth) ** 2
            half = 6 + 52 * depth
            draw.line([centre - half, row, centre + half, row], fill=(70, 70, 74))
            if int((1 - depth) * 24) % 4 < 2:
                draw.point((round_half_up(centre), row), fill=(235, 235, 235))
        # speed bar along the bottom edge (a visual cue for the waypoint spacing)
        draw.rectangle([2, size - 5, 2 + round_half_up(speed * 8), size - 3], fill=(250, 250, 250))
        return image


def make_vflash(root: Path) -> dict[str, int]:
    writer = VFlashWriter(root)
    counts: dict[str, int] = {}

    def forms(i: int) -> str:
        return "list" if i % 9 == 4 else "dict" if i % 9 == 7 else "path"

    rng = random.Random(4001)
    points = [writer.point_row(rng, f"scene_{1 + i:04d}", forms(i)) for i in range(28)]
    rng = random.Random(4002)
    boxes = [writer.box_row(rng, f"scene_{101 + i:04d}", forms(i), with_absent=i % 4 != 3) for i in range(20)]
    rng = random.Random(4003)
    robot2d = [
        writer.robot2d_row(rng, f"scene_{201 + i:04d}", forms(i), mask=i % 4 == 1, two_views=i in (5, 14))
        for i in range(23)
    ]
    robot2d.append(writer.robot2d_video_row(rng, "episode_0001"))
    rng = random.Random(4004)
    robot3d = [
        writer.robot3d_row(rng, f"scene_{301 + i:04d}", forms(i), mask=i % 5 == 2, with_count=i % 2 == 0)
        for i in range(12)
    ]
    rng = random.Random(4005)
    drive = [writer.drive_row(rng, f"scene_{401 + i:04d}", forms(i), with_count=i % 3 != 0) for i in range(12)]

    files = {"points": points, "boxes": boxes, "robot2d": robot2d, "robot3d": robot3d, "drive": drive}
    for stem, rows in files.items():
        counts[f"{stem}.jsonl"] = write_jsonl(root / f"{stem}.jsonl", rows)

    # held-out scenes: own seeds and image names, every kind
    rng = random.Random(4099)
    held_out = [writer.point_row(rng, f"eval_{1 + i:04d}", "path") for i in range(4)]
    held_out += [writer.box_row(rng, f"eval_{11 + i:04d}", "path", with_absent=i != 2) for i in range(3)]
    held_out += [writer.robot2d_row(rng, f"eval_{21 + i:04d}", "path", mask=False, two_views=False) for i in range(3)]
    held_out += [writer.robot3d_row(rng, f"eval_{31 + i:04d}", "path", mask=False, with_count=True) for i in range(3)]
    held_out += [writer.drive_row(rng, f"eval_{41 + i:04d}", "path", with_count=True) for i in range(3)]
    counts["eval.jsonl"] = write_jsonl(root / "eval.jsonl", held_out)

    entry_defaults = {"root": ".", "repeat_time": 1.0, "data_augment": False, "video_reader_backend": "pyav"}
    recipe = {
        "smoke_points": {"annotation": "points.jsonl", **entry_defaults, "length": counts["points.jsonl"]},
        "smoke_boxes": {"annotation": "boxes.jsonl", **entry_defaults, "repeat_time": 2.0,
                        "length": counts["boxes.jsonl"]},
        "smoke_robot2d": {
            "annotation": "robot2d.jsonl", **entry_defaults, "length": counts["robot2d.jsonl"],
            "visual_aug": {
                "prob": 0.3,
                "views": "all",
                "ops": ["motion_blur", "gaussian_blur", "zoom_blur", "fog", "glass_blur", "light"],
                "severity": [1, 10],
                "zoom_max_severity": 5,
            },
        },
        # list form of `annotation` (no `length`: the seed defines it for single-file entries)
        "smoke_robot3d": {"annotation": ["robot3d.jsonl"], **entry_defaults},
        "smoke_drive": {"annotation": "drive.jsonl", **entry_defaults, "length": counts["drive.jsonl"]},
    }
    write_json(root / "recipe.json", recipe)
    return counts


# --------------------------------------------------------------------------- Valen records


def valen_image(path: Path) -> None:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[0])
    draw = ImageDraw.Draw(image)
    for obj in (Obj("ball", "green", 14, 20, 34, 40), Obj("cup", "red", 60, 16, 74, 38),
                Obj("box", "blue", 90, 70, 114, 94), Obj("block", "yellow", 20, 90, 50, 102)):
        draw_object(draw, obj)
    save_png(image, path)


def valen_video(path: Path) -> None:
    """8 frames, 64x64: a red ball rolling from left to right."""
    size = VALEN_VIDEO_SIZE
    frames = []
    for i in range(8):
        image = Image.new("RGB", (size, size), BACKGROUNDS[1])
        draw = ImageDraw.Draw(image)
        draw.rectangle([0, 44, size - 1, size - 1], fill=(150, 120, 90))
        x = 4 + 6 * i
        draw.ellipse([x, 30, x + 13, 43], fill=COLOURS["red"])
        frames.append(image)
    write_mp4(frames, path)


def make_valen(root: Path) -> dict[str, int]:
    assets = root / "assets"
    valen_image(assets / "shapes.png")
    valen_video(assets / "clip.mp4")
    image_digest = sha256_file(assets / "shapes.png")
    video_digest = sha256_file(assets / "clip.mp4")

    records = [
        {  # the seed's example: text state, one question of each type, all hard labels
            "group_id": "traffic-light-001",
            "request": {
                "state": "The traffic light is green.",
                "questions": {
                    "color": {
                        "type": "choice",
                        "instructions": "Choose the observed traffic light color.",
                        "criteria": {"red": "Red light", "green": "Green light", "unknown": "Not visible"},
                    },
                    "go": {
                        "type": "noul",
                        "instructions": "Only a green light permits crossing. Is crossing permitted?",
                    },
                    "risk": {
                        "type": "score",
                        "instructions": "Rate the risk of crossing under this light.",
                        "criteria": ["Low: green light", "Medium: light not visible", "High: red light"],
                    },
                },
            },
            "targets": {
                "color": {"probabilities": {"red": 0.0, "green": 1.0, "unknown": 0.0}},
                "go": {"probabilities": {"true": 1.0, "false": 0.0}},
                "risk": {"probabilities": {"0": 1.0, "1": 0.0, "2": 0.0}},
            },
            "assets": [],
            "meta": {"record_id": "valen-smoke-001", "domain": "traffic", "modality": "text",
                     "language_bucket": "en"},
        },
        {  # soft noul label with provenance fields; an unlabeled question by a null target
            "group_id": "kitchen-stove-001",
            "request": {
                "state": "A pot of water is boiling on the stove and its handle sticks out over the edge of "
                         "the counter. A child is playing on the kitchen floor.",
                "questions": {
                    "hazard": {
                        "type": "noul",
                        "instructions": "Is there an immediate burn hazard in this kitchen?",
                    },
                    "severity": {
                        "type": "score",
                        "instructions": "Rate how severe the situation is.",
                        "criteria": ["None: nothing unsafe", "Minor: small risk", "Serious: injury likely",
                                     "Critical: act at once"],
                    },
                    "action": {
                        "type": "choice",
                        "instructions": "Choose the best next action.",
                        "criteria": {"turn_handle": "Turn the pot handle inward",
                                     "remove_pot": "Take the pot off the stove",
                                     "nothing": "No action is needed"},
                    },
                },
            },
            "targets": {
                "hazard": {"probabilities": {"true": 0.75, "false": 0.25}, "label_source": "annotators",
                           "votes": {"true": 3, "false": 1}},
                "severity": {"probabilities": {"0": 0.0, "1": 0.0, "2": 1.0, "3": 0.0}},
                "action": None,
            },
            "assets": [],
            "meta": {"record_id": "valen-smoke-002", "domain": "home_safety", "modality": "text",
                     "language_bucket": "en"},
        },
        {  # image state as messages; the manifest lists the PNG with its digest
            "group_id": "tabletop-shapes-001",
            "request": {
                "state": {
                    "messages": [{
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Look at the objects on the table in the image."},
                            {"type": "image_url", "image_url": {"url": "assets/shapes.png"}},
                        ],
                    }],
                },
                "questions": {
                    "ball_color": {
                        "type": "choice",
                        "instructions": "Which color is the ball?",
                        "criteria": {"red": "A red ball", "green": "A green ball", "blue": "A blue ball"},
                    },
                    "has_cup": {"type": "noul", "instructions": "Is there a cup on the table?"},
                    "clutter": {
                        "type": "score",
                        "instructions": "Rate how cluttered the table is.",
                        "criteria": ["Empty: no objects", "Tidy: a few separated objects",
                                     "Cluttered: many overlapping objects"],
                    },
                },
            },
            "targets": {
                "ball_color": {"probabilities": {"red": 0.0, "green": 1.0, "blue": 0.0}},
                "has_cup": {"probabilities": {"true": 1.0, "false": 0.0}},
                "clutter": {"probabilities": {"0": 0.0, "1": 1.0, "2": 0.0}},
            },
            "assets": [{"path": "assets/shapes.png", "sha256": image_digest}],
            "meta": {"record_id": "valen-smoke-003", "domain": "tabletop", "modality": "image",
                     "language_bucket": "en"},
        },
        {  # Chinese text state; a soft choice label
            "group_id": "weather-umbrella-001",
            "request": {
                "state": "窗外乌云密布，地面已经湿了，行人撑着伞匆匆走过。",
                "questions": {
                    "umbrella": {"type": "noul", "instructions": "出门需要带伞吗？"},
                    "weather": {
                        "type": "choice",
                        "instructions": "选择最符合描述的天气。",
                        "criteria": {"rain": "正在下雨", "cloudy": "多云但没有下雨", "sunny": "晴天"},
                    },
                },
            },
            "targets": {
                "umbrella": {"probabilities": {"true": 1.0, "false": 0.0}},
                "weather": {"probabilities": {"rain": 0.5, "cloudy": 0.5, "sunny": 0.0},
                            "label_source": "annotators", "votes": {"rain": 1, "cloudy": 1, "sunny": 0}},
            },
            "assets": [],
            "meta": {"record_id": "valen-smoke-004", "domain": "weather", "modality": "text",
                     "language_bucket": "zh"},
        },
        {  # video state with a plain-string system message
            "group_id": "rolling-ball-001",
            "request": {
                "state": {
                    "messages": [
                        {"role": "system", "content": "You describe motion in short video clips."},
                        {"role": "user", "content": [
                            {"type": "text", "text": "Watch the ball in this clip."},
                            {"type": "video_url", "video_url": {"url": "assets/clip.mp4"}},
                        ]},
                    ],
                },
                "questions": {
                    "direction": {
                        "type": "choice",
                        "instructions": "In which direction does the ball move?",
                        "criteria": {"left": "Toward the left edge", "right": "Toward the right edge",
                                     "still": "It does not move"},
                    },
                    "moving": {"type": "noul", "instructions": "Is the ball moving during the clip?"},
                },
            },
            "targets": {
                "direction": {"probabilities": {"left": 0.0, "right": 1.0, "still": 0.0}},
                "moving": {"probabilities": {"true": 1.0, "false": 0.0}},
            },
            "assets": [{"path": "assets/clip.mp4", "sha256": video_digest}],
            "meta": {"record_id": "valen-smoke-005", "domain": "motion", "modality": "video",
                     "language_bucket": "en"},
        },
        {  # an unlabeled question by an omitted target
            "group_id": "review-headphones-001",
            "request": {
                "state": "Review: The headphones sound great, but the left ear cup cracked after two weeks "
                         "and support has not answered my emails.",
                "questions": {
                    "satisfaction": {
                        "type": "score",
                        "instructions": "Rate the customer's overall satisfaction.",
                        "criteria": ["Very unhappy", "Unhappy", "Neutral", "Happy", "Very happy"],
                    },
                    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
                },
            },
            "targets": {
                "satisfaction": {"probabilities": {"0": 0.0, "1": 1.0, "2": 0.0, "3": 0.0, "4": 0.0}},
            },
            "assets": [],
            "meta": {"record_id": "valen-smoke-006", "domain": "reviews", "modality": "text",
                     "language_bucket": "en"},
        },
    ]
    for record in records:
        for target in (record.get("targets") or {}).values():
            if target is not None and target.get("probabilities") is not None:
                assert math.isclose(sum(target["probabilities"].values()), 1.0, abs_tol=1e-6)
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
    text_lines = [line for line, r in zip(lines, records, strict=True) if r["meta"]["modality"] == "text"]
    held_out = [json.dumps(r, ensure_ascii=False) + "\n" for r in VALEN_HELD_OUT]
    for name, chunk in (("train.jsonl", lines), ("text.jsonl", text_lines), ("eval.jsonl", held_out)):
        with (root / name).open("w", encoding="utf-8", newline="\n") as f:
            f.writelines(chunk)
    return {"train.jsonl": len(lines), "text.jsonl": len(text_lines), "eval.jsonl": len(held_out)}


# configs/valen.py's held-out set (seed 003: train and eval kept apart): text records of group_ids
# and states that train.jsonl does not hold, every question type.
VALEN_HELD_OUT = [
    {"group_id": "crosswalk-signal-101",
     "request": {"state": "The pedestrian signal shows a red standing figure.", "questions": {
         "signal": {"type": "choice", "instructions": "Choose the pedestrian signal shown.",
                    "criteria": {"walk": "Walking figure", "stop": "Standing figure", "off": "Signal dark"}},
         "cross": {"type": "noul", "instructions": "Only a walking figure permits crossing. Is crossing permitted?"},
         "risk": {"type": "score", "instructions": "Rate the risk of crossing now.",
                  "criteria": ["Low: walking figure", "Medium: signal dark", "High: standing figure"]}}},
     "targets": {"signal": {"probabilities": {"walk": 0.0, "stop": 1.0, "off": 0.0}},
                 "cross": {"probabilities": {"true": 0.0, "false": 1.0}},
                 "risk": {"probabilities": {"0": 0.0, "1": 0.0, "2": 1.0}}},
     "assets": [],
     "meta": {"record_id": "valen-heldout-001", "domain": "traffic", "modality": "text", "language_bucket": "en"}},
    {"group_id": "kettle-boil-101",
     "request": {"state": "The kettle has boiled and switched itself off; steam is fading.", "questions": {
         "hazard": {"type": "choice", "instructions": "Choose the main hazard right now.",
                    "criteria": {"burn": "Hot surface or steam", "fire": "Open flame", "none": "No hazard"}},
         "safe": {"type": "noul", "instructions": "Is it safe to touch the kettle body with bare hands?"}}},
     "targets": {"hazard": {"probabilities": {"burn": 1.0, "fire": 0.0, "none": 0.0}},
                 "safe": {"probabilities": {"true": 0.0, "false": 1.0}}},
     "assets": [],
     "meta": {"record_id": "valen-heldout-002", "domain": "home_safety", "modality": "text",
              "language_bucket": "en"}},
    {"group_id": "snow-boots-101",
     "request": {"state": "Heavy snow is falling and the pavement is icy.", "questions": {
         "footwear": {"type": "choice", "instructions": "Choose the footwear to wear outside.",
                      "criteria": {"boots": "Winter boots", "sandals": "Sandals", "slippers": "Slippers"}},
         "slippery": {"type": "noul", "instructions": "Is the pavement likely to be slippery?"}}},
     "targets": {"footwear": {"probabilities": {"boots": 1.0, "sandals": 0.0, "slippers": 0.0}},
                 "slippery": {"probabilities": {"true": 1.0, "false": 0.0}}},
     "assets": [],
     "meta": {"record_id": "valen-heldout-003", "domain": "weather", "modality": "text", "language_bucket": "en"}},
    {"group_id": "review-blender-101",
     "request": {"state": "Review: the blender is loud but crushes ice well; I would buy it again.", "questions": {
         "satisfaction": {"type": "score", "instructions": "Rate the reviewer's satisfaction.",
                          "criteria": ["Very unhappy", "Unhappy", "Neutral", "Happy", "Very happy"]},
         "refund": {"type": "noul", "instructions": "Does the reviewer ask for a refund?"}}},
     "targets": {"satisfaction": {"probabilities": {"0": 0.0, "1": 0.0, "2": 0.0, "3": 1.0, "4": 0.0}},
                 "refund": {"probabilities": {"true": 0.0, "false": 1.0}}},
     "assets": [],
     "meta": {"record_id": "valen-heldout-004", "domain": "reviews", "modality": "text", "language_bucket": "en"}},
]


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> dict[str, dict[str, int]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/smoke", help="output folder (replaced)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    for sub in ("vflash", "valen"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
        (out / sub).mkdir(parents=True)
    counts = {"vflash": make_vflash(out / "vflash"), "valen": make_valen(out / "valen")}
    for sub, files in counts.items():
        for name, n in files.items():
            log(f"{out / sub / name}: {n} rows")
    return counts


if __name__ == "__main__":
    main()
