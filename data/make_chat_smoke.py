"""Write the chat-format smoke set (seed 003): plain rows, tool calls with results, images.

    python data/make_chat_smoke.py [--out data/smoke/chat]

Deterministic: the same command writes byte-identical files. Rows cover a system prompt,
multi-turn exchanges, a declared tool called with ordered arguments and answered by a tool
message, and user messages carrying an image part (path relative to the JSONL).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("square", "circle")
CITIES = {"Wellington": "18C and windy", "Oslo": "2C and snowing", "Lima": "24C and sunny",
          "Nairobi": "21C and cloudy", "Osaka": "15C and raining", "Quito": "13C and misty"}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Look up the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}


def shape_image(path: Path, color: str, shape: str) -> None:
    image = Image.new("RGB", (64, 64), (245, 245, 240))
    draw = ImageDraw.Draw(image)
    box = (16, 16, 48, 48)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[color])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=False)


def invoice_row(rng: random.Random) -> dict:
    number, items = rng.randint(1000, 9999), rng.randint(1, 9)
    total = rng.randint(10, 5000)
    return {"messages": [
        {"role": "system", "content": "Extract the invoice total as JSON."},
        {"role": "user", "content": f"Invoice {number}, {items} items, total due {total}.00 EUR"},
        {"role": "assistant", "content": json.dumps({"total": total})},
    ]}


def weather_row(rng: random.Random, index: int) -> dict:
    city = rng.choice(sorted(CITIES))
    call_id = f"call_{index}"
    return {"tools": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": CITIES[city]},
        {"role": "assistant", "content": f"It is {CITIES[city]} in {city}."},
    ]}


def counting_row(rng: random.Random) -> dict:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return {"messages": [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a + b}"},
        {"role": "user", "content": "And doubled?"},
        {"role": "assistant", "content": f"{2 * (a + b)}"},
    ]}


def image_row(rng: random.Random, root: Path, index: int) -> dict:
    color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
    name = f"images/shape_{index:03d}.png"
    shape_image(root / name, color, shape)
    return {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What color is the shape?"},
                                     {"type": "image", "path": name}]},
        {"role": "assistant", "content": f"A {color} {shape}."},
    ]}


def rows(rng: random.Random, root: Path, count: int, offset: int) -> list[dict]:
    makers = (lambda i: invoice_row(rng), lambda i: weather_row(rng, i), lambda i: counting_row(rng),
              lambda i: image_row(rng, root, i))
    return [makers[i % len(makers)](offset + i) for i in range(count)]


def write_jsonl(path: Path, data: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in data), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/smoke/chat")
    root = Path(parser.parse_args(argv).out)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(3)
    write_jsonl(root / "train.jsonl", rows(rng, root, 48, 0))
    write_jsonl(root / "eval.jsonl", rows(rng, root, 12, 1000))


if __name__ == "__main__":
    main()
