"""Serving a VFlash workdir (issue 31): each choice carries the `valen` extension field — the parsed
primitives with dequantised coordinates, the atomic_decoding calls and the parse error — computed by
`evaluation.answers.vflash_fields`, the code `python -m valen_jax.generate` writes answers.jsonl with.

Images are not served yet, so the prompts are text only (the data's instruction without its image) and
an image part is refused. The tiny model's answers are whatever 4 training steps make of that prompt:
the served text is checked against offline `generate`, and its `valen` field against `vflash_fields` of
that text, both for the plain and the streamed answer; a known primitive answer pins the dequantisation.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from flax import nnx

from data_pipeline.primitives import coordinates, parse_answer
from tests.serve_server import Served
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT
from valen_jax.evaluation.answers import vflash_fields
from valen_jax.generate import generate

PROMPT = ("Show me the centre of the red box as a point. Use tokens <0> to <1000>: x from the left edge, "
          "y from the top edge.")
MAX_NEW = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = Served(smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny"), slots=2, max_queue=8)
    yield served
    served.close()


def post(served, body: dict) -> httpx.Response:
    return httpx.post(served.url + "/v1/chat/completions", json=dict(body, model=served.service.name), timeout=120)


@pytest.mark.slow
def test_vflash_answers_carry_generate_primitives(served):
    messages = [{"role": "user", "content": PROMPT}]
    answer = post(served, {"messages": messages, "max_tokens": MAX_NEW}).json()
    (choice,) = answer["choices"]
    run = served.service.restored
    want = generate(nnx.merge(run.graphdef, run.params), [messages], tokenizer=run.tokenizer,
                    max_new_tokens=MAX_NEW)[0]
    assert choice["message"]["content"] == want
    assert choice["valen"] == vflash_fields(want, None)
    assert set(choice["valen"]) == {"primitives", "atomic_decoding", "parse_error"}

    # Streamed: the last chunk of the choice carries the same field.
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=120,
                      json={"model": served.service.name, "messages": messages, "max_tokens": MAX_NEW,
                            "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] is not None and last["valen"] == choice["valen"]
    assert all("valen" not in c["choices"][0] for c in chunks[:-1])

    # /v1/completions carries it too.
    completion = httpx.post(served.url + "/v1/completions", timeout=120,
                            json={"model": served.service.name, "prompt": PROMPT, "max_tokens": MAX_NEW}).json()
    assert completion["choices"][0]["valen"] == vflash_fields(completion["choices"][0]["text"], None)


def test_vflash_extension_dequantises_a_primitive_answer(served):
    text = "<point><902><500></point>"
    field = served.service.extension(text)
    (primitive,), _ = parse_answer(text)
    assert field["parse_error"] is None
    (point,) = field["primitives"]
    assert point["kind"] == "point" and point["tokens"] == [902, 500]
    np.testing.assert_allclose(point["coordinates"], coordinates(primitive))
    assert point["units"] == "image fraction (x, y)"
    assert served.service.extension("<point><902></point>") == {"primitives": [], "atomic_decoding": [], "parse_error": "at char 0: <point> needs 2 numbers (x, y), got 1"}


def test_vflash_image_parts_are_served_and_a_bad_one_names_its_field(served):
    bad = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
    refused = post(served, {"messages": [{"role": "user", "content": bad}]})
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == (400, "invalid_image",
                                                                    "messages[0].content[1].image_url.url")
    url = "data:image/png;base64," + base64.b64encode((ROOT / "data/smoke/chat/images/shape_003.png").read_bytes()).decode()
    good = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
    answer = post(served, {"messages": [{"role": "user", "content": good}], "max_tokens": MAX_NEW})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["valen"] == vflash_fields(choice["message"]["content"] or "", None)
