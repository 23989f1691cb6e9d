"""Our KV-cache greedy decoding (`decoding.engine.generate_ids`) equals transformers'
`generate(do_sample=False)` token for token, for tiny random Qwen2 and Llama checkpoints (issue 15).

Both sides run in f32 on the same 20 random prompts of 2–40 tokens: once as one batch of mixed
lengths (transformers left-pads with an attention mask; our engine takes per-row lengths) and once
one prompt at a time. The end-of-sequence id is chosen from the models' own free-running output so
that some rows stop early on it and some run to `max_new_tokens`: that checks per-row stopping.
transformers keeps writing the pad id after a finished row's eos, so its rows are cut after the
first eos (kept) before comparing; ours stop there by contract.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from tests.test_hf_parity import COMMON, _random_hf_model  # noqa: E402  (the one tiny-model recipe)
from valen_jax.decoding.engine import generate_ids  # noqa: E402
from valen_jax.models import hf  # noqa: E402

VOCAB = COMMON["vocab_size"]
PROMPTS = 20
NEW_TOKENS = 24
PAD = 0  # transformers' filler after a finished row; a real token too, so rows are cut at eos, never at PAD


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n) for n in rng.integers(2, 41, PROMPTS)]


def _cut_after_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def _hf_one_at_a_time(model, prompts, eos: int | None) -> list[list[int]]:
    out = []
    for ids in prompts:
        tokens = torch.tensor(ids)[None]
        with torch.no_grad():
            generated = model.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD)
        out.append(_cut_after_eos(generated[0, len(ids):].tolist(), eos))
    return out


def _hf_batch(model, prompts, eos: int | None) -> list[list[int]]:
    longest = max(len(ids) for ids in prompts)
    tokens = torch.full((len(prompts), longest), PAD, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for row, ids in enumerate(prompts):  # left padding: every row's last prompt token is at the end
        tokens[row, longest - len(ids):] = torch.tensor(ids)
        mask[row, longest - len(ids):] = 1
    with torch.no_grad():
        generated = model.generate(tokens, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=eos, pad_token_id=PAD)
    return [_cut_after_eos(row[longest:].tolist(), eos) for row in generated]


def _eos_stopping_some_rows(free_runs: list[list[int]]) -> int:
    """The token that, made the eos, stops the most rows early while leaving the most rows to run to
    the budget (max of min(stopped, unstopped); ties: smallest id). Stopping is judged before the
    last step, so a stopped row is shorter than NEW_TOKENS."""
    rows_with = collections.Counter(t for run in free_runs for t in set(run[:-1]))
    return max(sorted(rows_with), key=lambda t: min(rows_with[t], len(free_runs) - rows_with[t]))


def _ours(params, graphdef, prompts, eos: int, local_batch: int | None) -> list[list[int]]:
    batch = [{"ids": ids.astype(np.int32), "positions": np.arange(len(ids), dtype=np.int32)} for ids in prompts]
    return generate_ids(params, graphdef, batch, max_new_tokens=NEW_TOKENS, stop_ids=[eos], vocab=VOCAB,
                        local_batch=local_batch)


@pytest.fixture(scope="module", params=["qwen2", pytest.param("llama", marks=pytest.mark.slow)])
def case(request, tmp_path_factory):
    """(family, prompts, eos, transformers one at a time, transformers batched, params, graphdef)."""
    directory = tmp_path_factory.mktemp(f"generate_{request.param}")
    reference = _random_hf_model(request.param, directory)
    prompts = _prompts()
    threads = torch.get_num_threads()
    # One intra-op thread: a 64-wide model gains nothing from more, and on a shared CPU torch's
    # spinning worker threads made these ~300 tiny generate steps 20x slower.
    torch.set_num_threads(1)
    try:
        eos = _eos_stopping_some_rows(_hf_batch(reference, prompts, eos=None))
        single, batched = _hf_one_at_a_time(reference, prompts, eos), _hf_batch(reference, prompts, eos)
    finally:
        torch.set_num_threads(threads)
    stopped = sum(len(run) < NEW_TOKENS for run in single)
    # The comparison must exercise per-row stopping both ways, or it proves less than it claims.
    assert 3 <= stopped <= PROMPTS - 3, (request.param, eos, stopped)
    model, _ = hf.from_pretrained(directory)  # float32 parameters and compute
    graphdef, params = nnx.split(model)
    return request.param, prompts, eos, single, batched, params, graphdef


def test_one_batch_of_mixed_lengths_equals_transformers(case):
    family, prompts, eos, single, batched, params, graphdef = case
    assert batched == single, "transformers' left-padded batch disagrees with its own single-prompt runs"
    ours = _ours(params, graphdef, prompts, eos, local_batch=None)
    for row, (mine, theirs) in enumerate(zip(ours, batched, strict=True)):
        assert mine == theirs, f"{family} row {row} (prompt of {len(prompts[row])} tokens, eos {eos})"


def test_one_prompt_at_a_time_equals_transformers(case):
    family, prompts, eos, single, _, params, graphdef = case
    for row, ids in enumerate(prompts):
        [mine] = _ours(params, graphdef, [ids], eos, local_batch=1)
        assert mine == single[row], f"{family} prompt {row} ({len(ids)} tokens, eos {eos})"
