"""Issue 54: `logprobs` on both routes (OpenAI's shapes), against the smoke chat workdir served for real.

Every log-probability is compared with an offline teacher-forced forward of the served model (its
`__call__` over the whole sequence, float32 log-softmax over the tokenizer's vocabulary, computed here
in numpy), within 1e-4: completions with `echo` (the prompt scored; the request lm-eval's
`local-completions` sends for loglikelihood tasks), `max_tokens` 0 with echo, streamed and non-streamed
completions agreeing entry for entry. Chat log-probabilities are in tests/test_serve_openai_tools.py
(a scripted engine: the tiny model's chat answers are empty)."""

from __future__ import annotations

import httpx
import jax
import numpy as np
import openai
import pytest
from flax import nnx

from tests.serve_server import Served
from tests.smoke_workdirs import smoke_workdir

PROMPT = "The weather in Wellington is windy"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    served = Served(workdir, slots=2, max_queue=8)
    yield served
    served.close()


def offline(served, ids: list[int]) -> np.ndarray:
    """[len(ids) - 1, V]: log p(. | ids[:t + 1]) from one forward of the served model over `ids`."""
    run, vocab = served.service.restored, len(served.service.tokenizer)
    model = nnx.merge(run.graphdef, run.params)
    tokens = np.asarray([ids], np.int32)
    positions = np.arange(len(ids), dtype=np.int32)[None]
    logits = np.asarray(model(tokens, positions, np.ones_like(tokens)), np.float64)[0, :-1, :vocab]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def post(served, body: dict) -> dict:
    response = httpx.post(served.url + "/v1/completions", json={"model": served.service.name, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_scores_the_prompt_as_the_model_does(served):
    tokenizer = served.service.tokenizer
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    # lm-eval's loglikelihood request, as `local-completions` sends it with a tokenizer (a batch of id lists).
    answer = post(served, {"prompt": [ids], "max_tokens": 1, "logprobs": 3, "echo": True, "temperature": 0,
                           "seed": 1234})
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    greedy = int(np.argmax(offline(served, [*ids, 0])[-1]))  # the row after the prompt's last token
    sequence = [*ids, greedy]
    want = offline(served, sequence)
    texts = [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in sequence]
    assert logprobs["tokens"] == texts
    # A generated end-of-turn token is listed (as OpenAI lists <|endoftext|>) but is not text.
    assert choice["text"] == PROMPT + ("" if greedy == served.service.eot else texts[-1])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], want[np.arange(len(ids)), sequence[1:]], atol=1e-4)
    for t, top in enumerate(logprobs["top_logprobs"][1:]):
        assert len(top) == 3
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(want[t])[::-1][:3], atol=1e-4)
    # The generated token is the greedy one: its log-probability is the top one (lm-eval's `is_greedy`).
    assert logprobs["token_logprobs"][-1] == max(logprobs["top_logprobs"][-1].values())
    assert logprobs["text_offset"] == list(np.cumsum([0, *map(len, texts[:-1])]))
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}


def test_echo_without_new_tokens(served):
    ids = served.service.tokenizer.encode(PROMPT, add_special_tokens=False)
    answer = post(served, {"prompt": PROMPT, "max_tokens": 0, "logprobs": 0, "echo": True})
    (choice,) = answer["choices"]
    assert choice["text"] == PROMPT and answer["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert all(top == {} for top in choice["logprobs"]["top_logprobs"][1:])
    want = offline(served, ids)
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], want[np.arange(len(ids) - 1), ids[1:]],
                               atol=1e-4)
    refused = httpx.post(served.url + "/v1/completions", json={"model": served.service.name, "prompt": PROMPT,
                                                               "max_tokens": 0}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_several_prompts_are_choices_in_order(served):
    prompts = ["Hello", PROMPT]
    answer = post(served, {"prompt": prompts, "max_tokens": 1, "echo": True})
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert [c["text"][:len(p)] for c, p in zip(answer["choices"], prompts, strict=True)] == prompts


def test_streamed_completion_logprobs_equal_non_streamed(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    rambling = "The weather in Wellington is"  # the tiny model goes on until its budget
    ask = dict(model=served.service.name, prompt=rambling, max_tokens=9, logprobs=2)
    plain = client.completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    entries = [c.logprobs for c in chunks if c.logprobs is not None]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for e in entries for x in getattr(e, field)] == getattr(plain.logprobs, field), field
    assert plain.finish_reason == "length" and len(plain.logprobs.tokens) == 9
    assert "".join(plain.logprobs.tokens) == plain.text == "".join(c.text for c in chunks)
    tokenizer = served.service.tokenizer
    ids = tokenizer.encode(rambling, add_special_tokens=False)
    generated = tokenizer.encode(plain.text, add_special_tokens=False)
    want = offline(served, ids + generated)[len(ids) - 1:]
    np.testing.assert_allclose(plain.logprobs.token_logprobs, want[np.arange(len(generated)), generated], atol=1e-4)
