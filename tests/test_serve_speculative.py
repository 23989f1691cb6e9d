"""`python -m valen_jax.serve --drafter=WORKDIR` (issue 31): announced blocks decoded speculatively in the
decode slots, the answers the target's own (greedy: token for token offline `generate_ids`), with the
verify passes and accepted tokens in `usage`; a drafter trained against other weights is refused.

The tiny vflash target (4 training steps) does not announce blocks by itself, so the prompts that test the
drafted path end with an `atomic_decoding` call: the block is drafted from output 0, as evaluation's
`--from-call` does. One call is in the compact spelling the device's automaton reads; one has spaces, so
its slot is held and the host reads it (`AtomicCalls.announced`)."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading

import httpx
import numpy as np
import openai
import pytest

from data_pipeline.primitives import AtomicCalls
from tests.serve_server import Served, serve_together
from tests.smoke_workdirs import smoke_workdir
from tests.test_serve import IMAGE, image_message
from tests.train_runs import run_train
from valen_jax.decoding.engine import bucket, generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.decoding.speculative import ScriptedDrafter
from valen_jax.serve import load_service
from valen_jax.serving.protocol import ChatRequest
from valen_jax.serving.slots import Request
from valen_jax.serving.speculative_slots import SpeculativeSlotEngine
from valen_jax.training.checkpoint import CheckpointError

pytestmark = pytest.mark.heavy

BLOCK = 14
COMPACT = ('move the red cup left<action>Pull.</action><tool_call>{"name":"atomic_decoding","arguments":'
           f'{{"block_size":{BLOCK}}}}}</tool_call>')
SPACED = ('drive ahead<tool_call>{"name": "atomic_decoding", "arguments": '
          f'{{"block_size": {BLOCK}}}}}</tool_call>')
PLAIN = "Where is the red ball? Answer with a point."


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the tiny vflash target, a drafter trained 4 steps against it)."""
    home = tmp_path_factory.mktemp("serve-speculative")
    target = home / "target"
    shutil.copytree(smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny"), target)
    drafter = home / "drafter"
    run_train("configs/vflash.py:tiny,drafter", drafter, f"--config.model.target_from={target}",
              "--config.train.steps=4", "--config.train.checkpoint_every=4", "--config.train.learning_rate=0.01")
    return target, drafter


@pytest.fixture(scope="module")
def served(runs):
    target, drafter = runs
    served = Served(target, slots=4, max_queue=32, drafter=drafter)
    yield served
    served.close()


def ids_of(served, text: str) -> list[int]:
    return served.service.tokenizer.encode(text, add_special_tokens=False)


def offline(served, ids: list[int], budget: int) -> list[int]:
    run, service = served.service.restored, served.service
    return generate_ids(run.params, run.graphdef, [{"ids": np.asarray(ids, np.int32),
                                                   "positions": np.arange(len(ids), dtype=np.int32)}],
                        max_new_tokens=budget, stop_ids=(service.eot,), vocab=len(service.tokenizer))[0]


def complete(served, ids: list[int], budget: int, **extra) -> dict:
    body = {"model": served.service.name, "prompt": ids, "max_tokens": budget, **extra}
    response = httpx.post(served.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(served, ids: list[int]) -> str:
    service = served.service
    ids = ids[:-1] if ids and ids[-1] == service.eot else ids
    return service.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("prompt", [COMPACT, SPACED], ids=["device-read", "host-read"])
def test_a_block_announced_by_the_prompt_is_drafted_and_the_answer_is_the_targets(served, prompt):
    ids = ids_of(served, prompt)
    want = offline(served, ids, BLOCK + 6)
    answer = complete(served, ids, BLOCK + 6)
    assert answer["choices"][0]["text"] == text_of(served, want)
    usage = answer["usage"]
    assert usage["completion_tokens"] == len(want)
    spec = usage["valen"]
    # The block (or what of it the answer reached) was verified in passes, each committing >= 1 token.
    assert spec["verify_passes"] >= 1 and spec["block_tokens"] >= spec["verify_passes"]
    assert spec["block_tokens"] <= min(BLOCK + 1, len(want))  # a pass's bonus may follow the block
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == spec["accepted_tokens"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == spec["drafted_tokens"]
    assert spec["accepted_tokens"] == spec["block_tokens"] - spec["verify_passes"]  # the bonus of each pass
    # This untrained drafter may miss twice in a row: the rest of the block is then plain steps, counted apart.
    assert spec["stopped_spans"] <= 1 and spec["undrafted_tokens"] <= BLOCK * spec["stopped_spans"]
    assert spec["block_tokens"] + spec["undrafted_tokens"] >= min(BLOCK, len(want))


def test_a_plain_answer_runs_no_verify_pass_and_equals_generate(served):
    ids = ids_of(served, PLAIN)
    want = offline(served, ids, 10)
    answer = complete(served, ids, 10)
    assert answer["choices"][0]["text"] == text_of(served, want)
    assert answer["usage"]["valen"]["verify_passes"] == 0


def test_the_first_token_comes_from_the_prefill_unless_the_prompt_announces_a_block(served):
    """A plain prompt's first token is drawn from its prefill, as in plain serving: one token asked, no
    sync runs. A prompt announcing a block gets its first token from a verify pass (the block drafted from
    output 0), so a sync runs; both answers are generate's."""
    engine = served.service.engine
    for text, syncs in ((PLAIN, 0), (COMPACT, 1)):
        ids = ids_of(served, text)
        before = engine.steps
        answer = complete(served, ids, 1)
        assert answer["choices"][0]["text"] == text_of(served, offline(served, ids, 1)), text
        assert engine.steps - before == syncs * engine.steps_per_sync, text
        assert answer["usage"]["valen"]["verify_passes"] == syncs, text


def test_a_call_being_written_has_its_fixed_text_verified_and_the_answer_is_the_targets(served):
    """A prompt ending with <tool_call>: the first pass verifies the spelling's fixed text (`{"name":...`),
    which this random target rejects, committing its own token: the answer is still generate's."""
    ids = ids_of(served, PLAIN + "<tool_call>")
    want = offline(served, ids, 8)
    answer = complete(served, ids, 8)
    assert answer["choices"][0]["text"] == text_of(served, want)
    spec = answer["usage"]["valen"]
    assert spec["spelling_passes"] >= 1 and spec["spelling_tokens"] >= spec["spelling_passes"]
    assert spec["verify_passes"] == 0  # no block: the spelling pass is not counted as one


def test_concurrent_requests_with_blocks_at_different_places_each_equal_offline(served):
    # Different prompt lengths, budgets and block positions (from output 0, or none), 4 slots for 10 requests.
    prompts = [ids_of(served, p) for p in (COMPACT, PLAIN, SPACED, "hello " + COMPACT, "snow rain", PLAIN + " now",
                                           COMPACT, "a b c " + SPACED, "cloudy and wet", "x " + COMPACT)]
    budgets = [BLOCK + 3, 6, BLOCK + 1, 9, 5, 12, 4, BLOCK + 8, 7, BLOCK]
    want = [offline(served, ids, budget) for ids, budget in zip(prompts, budgets, strict=True)]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        got = list(pool.map(lambda pb: complete(served, *pb), zip(prompts, budgets, strict=True)))
    for answer, ids in zip(got, want, strict=True):
        assert answer["choices"][0]["text"] == text_of(served, ids)
        assert answer["usage"]["completion_tokens"] == len(ids)


def test_streamed_openai_client_and_seeded_sampling(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    ids = ids_of(served, COMPACT)
    pieces = [c.choices[0].text for c in client.completions.create(model=served.service.name, prompt=ids,
                                                                    max_tokens=BLOCK, stream=True)]
    assert "".join(pieces) == text_of(served, offline(served, ids, BLOCK))
    sampled = [client.completions.create(model=served.service.name, prompt=ids, max_tokens=BLOCK, temperature=1.0,
                                         seed=7) for _ in range(2)]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text
    assert sampled[0].usage.completion_tokens_details.accepted_prediction_tokens is not None


def test_slots_of_different_samplings_share_one_sync_and_draw_what_each_draws_alone(served):
    """Greedy, temperature, top-k and top-p in the 4 slots at once, prompts ending in an announced block: each
    answer equals the same request served alone (its own kind of program), token for token, and the greedy
    one the offline engine's. The numbers are arrays of the sync program: one request served again with
    other numbers of the same kind compiles nothing."""
    from valen_jax.serving.speculative_slots import _sync_program

    engine = served.service.engine
    prompts = [ids_of(served, COMPACT), ids_of(served, "push the blue box" + COMPACT[len("move the red cup left"):]),
               ids_of(served, COMPACT), ids_of(served, SPACED)]
    samplings = [Sampling(), Sampling(temperature=0.8), Sampling(temperature=1.0, top_k=5),
                 Sampling(temperature=1.2, top_p=0.9)]

    def requests():
        return [Request(np.asarray(ids, np.int32), BLOCK + 4, sampling, seed, 0, None)
                for seed, (ids, sampling) in enumerate(zip(prompts, samplings, strict=True))]

    alone = []
    for request in requests():
        serve_together(engine, [request])
        alone.append(request.tokens)
    together = requests()
    serve_together(engine, together)
    assert [r.tokens for r in together] == alone
    assert alone[0] == offline(served, prompts[0], BLOCK + 4)
    assert sum(r.speculation["verify_passes"] for r in together) > 0

    def one(round_: int) -> list[int]:
        sampling = Sampling(temperature=0.6 + 0.1 * round_, top_k=5 + round_, top_p=0.9 - 0.05 * round_)
        request = Request(np.asarray(prompts[0], np.int32), 6, sampling, 3, 0, None)
        serve_together(engine, [request])
        return request.tokens

    one(0)
    compiled = _sync_program.cache_info().misses
    one(1), one(2)
    assert _sync_program.cache_info().misses == compiled


def test_an_image_prompt_is_prefilled_with_its_patches_and_answers_as_offline(served):
    """The vflash target has a vision tower: the speculative prefill (the prompt but its last token) carries
    the image's patches and positions; the greedy answer equals the offline engine's on the same prompt."""
    service, run = served.service, served.service.restored
    prompt = service.chat_prompt(ChatRequest(model=service.name, messages=[image_message(IMAGE)]))
    assert prompt["vision"] is not None
    want = generate_ids(run.params, run.graphdef, [prompt], max_new_tokens=8, stop_ids=(service.eot,),
                        vocab=len(service.tokenizer))[0]
    body = {"model": service.name, "messages": [image_message(IMAGE)], "max_tokens": 8}
    answer = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert answer["usage"]["completion_tokens"] == len(want)
    assert answer["choices"][0]["message"]["content"] == text_of(served, want)


def test_a_one_token_prompt_is_refused_naming_the_prompt(served):
    body = {"model": served.service.name, "prompt": ids_of(served, "snow")[:1], "max_tokens": 4}
    response = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt" and "at least 2" in response.json()["error"]["message"]


def test_models_names_the_drafter(served, runs):
    card = httpx.get(served.url + "/v1/models", timeout=60).json()["data"][0]["valen"]["drafter"]
    assert card["workdir"] == str(runs[1].resolve()) and card["step"] == 4 and card["block_size"] > 0


def test_a_drafter_trained_against_other_weights_is_refused(runs, tmp_path_factory):
    other = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")  # test_serve's
    with pytest.raises(CheckpointError, match="now holds other weights"):
        load_service(other, drafter=runs[1], warm=False)


def test_a_target_workdir_as_drafter_is_refused_naming_the_flag(runs):
    with pytest.raises(CheckpointError, match=r"^--drafter: .*holds no drafter \(not a vflash run\)"):
        load_service(runs[0], drafter=runs[0], warm=False)


def test_an_oracle_drafter_commits_the_block_in_one_pass(served):
    """The target's own greedy output as the draft (the oracle): the whole block is accepted in one verify
    pass, and the answer is still token for token the engine's."""
    service, run = served.service, served.service.restored
    ids = ids_of(served, COMPACT)
    want = offline(served, ids, BLOCK + 4)
    engine = SpeculativeSlotEngine(run.params, run.graphdef, drafter=ScriptedDrafter(want, block_size=BLOCK),
                                   calls=AtomicCalls(service.tokenizer), vocab=len(service.tokenizer),
                                   stop_ids=(service.eot,), slots=2, cache_length=bucket(service.context),
                                   max_queue=4)
    done = threading.Event()
    request = Request(np.asarray(ids, np.int32), BLOCK + 4, Sampling(), 0, 0,
                      lambda token: token is None and done.set())
    engine.submit(request)
    assert done.wait(300) and engine.failure is None
    engine.stop()
    assert request.tokens == want
    # One pass: the block's 14 drafted tokens accepted, and the target's own next token (tau = B + 1).
    assert request.speculation["verify_passes"] == 1
    assert request.speculation["accepted_tokens"] == BLOCK and request.speculation["block_tokens"] == BLOCK + 1


@pytest.mark.parametrize("background", [True, False], ids=["background", "greedy-only"])
def test_the_warm_up_compiles_the_sampled_syncs_in_the_background(served, caplog, background):
    """As tests/test_serve.py's warm-up test, for the speculative engine: after `warm()` and its background
    compile, a sampled request whose block is drafted syncs without compiling; with
    `warm(background=False)` it compiles its sync. Its own `steps_per_sync` per case: no other test
    compiled these programs."""
    from tests.test_serve import compiled_programs

    service = served.service
    run = service.restored
    engine = SpeculativeSlotEngine(run.params, run.graphdef, drafter=service.engine.drafter,
                                   calls=AtomicCalls(service.tokenizer), vocab=len(service.tokenizer), stop_ids=(),
                                   slots=2, cache_length=bucket(service.context), max_queue=4,
                                   steps_per_sync=3 if background else 5)
    try:
        engine.warm(background=background)
        engine.wait_warm()
        request = Request(np.asarray(ids_of(served, COMPACT), np.int32), BLOCK + 4,
                          Sampling(temperature=0.9, top_k=40, top_p=0.95), 7, 0, None)
        compiled = compiled_programs(caplog, lambda: serve_together(engine, [request]))
    finally:
        engine.stop()
    assert len(request.tokens) == BLOCK + 4 and request.speculation["verify_passes"] > 0
    assert ("jit(sync)" in compiled) == (not background), compiled
    if background:
        assert compiled == []
