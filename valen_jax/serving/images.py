"""Chat messages with image parts → the prompt `generate` would decode for the same conversation.

An image is only ever prepared one way (DESIGN: media travel as bytes, the processor runs with the
checkpoint's `media_kwargs`): the request becomes a seed-003 chat record whose images are files beside
it, the record is converted with the workdir's tokenizer and chat options (`evaluation.workdir.
load_examples`, what `generate` converts its data with), and its prompt is the one before the trained
answer (`evaluation.prompts.prompt_of`: media slots expanded by the processor, vision patches, positions).
A placeholder answer closes the record: the prompt is every token before it, so its text never matters.

Images come as `data:` URLs (base64); an `http(s)://` or `file://` URL is refused, since a server must
neither fetch the network nor read its own disk for a client.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import tempfile
from pathlib import Path

from data_pipeline.formats.errors import FormatError
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.data.media import decode_image
from valen_jax.evaluation.prompts import prompt_of
from valen_jax.evaluation.workdir import data_format, load_examples
from valen_jax.serving.errors import APIError
from valen_jax.training import checkpoint

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp|gif|bmp);base64,(.*)", re.DOTALL)
_PLACEHOLDER_ANSWER = "."
_PASSED_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}  # what seed 003 messages may hold


def image_bytes(url: str, where: str) -> tuple[bytes, str]:
    """(the image's bytes, its file suffix) from a base64 `data:image/...` URL."""
    found = _DATA_URL.fullmatch(url.strip())
    if found is None:
        kind = url.split(":", 1)[0] if ":" in url[:12] else "this"
        raise APIError(400, f"{where}: a {kind!r} URL; images are sent inline as data:image/png;base64,... "
                       "(the server fetches no URL and reads no file of its own)", where, "invalid_image_url")
    try:
        data = base64.b64decode(found.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: not valid base64", where, "invalid_image_url") from None
    try:
        decode_image(data)  # the loader's own decoder: a payload it cannot read is refused here, by its field
    except (OSError, ValueError) as error:
        raise APIError(400, f"{where}: not a readable image ({error})", where, "invalid_image") from None
    return data, "jpg" if found.group(1) == "jpeg" else found.group(1)


def vision_prompt(restored, messages: list[dict], tools: list[dict] | None) -> dict:
    """{"ids", "positions", "vision"} of the conversation `messages` (OpenAI shape, dumped) as `generate`
    builds them. Errors name the request's field (`messages[i].content[j]...`)."""
    with tempfile.TemporaryDirectory(prefix="valen-images-") as folder:
        turns = []
        for i, message in enumerate(messages):
            turn = {k: v for k, v in message.items() if k in _PASSED_KEYS and v is not None}
            if isinstance(message.get("content"), list):
                turn["content"] = []
                for j, part in enumerate(message["content"]):
                    if part["type"] == "text":
                        turn["content"].append({"type": "text", "text": part["text"]})
                        continue
                    data, suffix = image_bytes(part["image_url"]["url"], f"messages[{i}].content[{j}].image_url.url")
                    name = f"image_{i}_{j}.{suffix}"
                    (Path(folder) / name).write_bytes(data)
                    turn["content"].append({"type": "image", "path": name})
            turns.append(turn)
        record = {"messages": [*turns, {"role": "assistant", "content": _PLACEHOLDER_ANSWER}]}
        if tools:
            record["tools"] = tools
        data_file = Path(folder) / "request.jsonl"
        data_file.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
        _, options = data_format(restored, "chat")
        try:
            examples, _, _ = load_examples("chat", data_file, folder, checkpoint.tokenizer_dir(restored.workdir),
                                           restored.fingerprint, options)
            return prompt_of(examples[0], restored.spec, end_of_turn_id(restored.tokenizer))
        except FormatError as error:  # seed 003's validation of the record: its fields are the request's
            first = error.problems[0]
            where = re.sub(r"\.path$", ".image_url", first.field)
            raise APIError(400, f"{where}: {first.message}", where) from None
        except ValueError as error:  # the processor or the row layout refused the media (e.g. too many patches)
            raise APIError(400, f"messages: {error}", "messages", "invalid_image") from None
