"""Issue 16's losslessness on real data: with a random drafter, speculative greedy decoding equals the
engine's target-only greedy on EVERY smoke VFlash record (the training recipe's 96 and the eval set's 16),
on the restored smoke target (configs/vflash.py:tiny, the shared 4-step workdir: a vision tower, M-RoPE).

Each record is decoded from two prompts: its last answer's own prompt (what evaluation continues), and,
where the reference answer has an `atomic_decoding` call, the prompt through that call, so the block is
announced at once and every one of its tokens goes through draft → verify → accept. A random drafter is
almost never right, so nearly every pass rejects at position 1 and commits the target's own token: the
cropping and re-drafting path runs on every block token."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from data_pipeline.primitives import AtomicCalls
from data_pipeline.tokenizer import end_of_turn_id
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT
from valen_jax.decoding import generate_ids
from valen_jax.decoding.speculative import RandomDrafter, SpeculativeDecoder
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.run import restore_model
from valen_jax.training import checkpoint
from valen_jax.vflash import evaluation as speculative

SMOKE = ROOT / "data/smoke/vflash"
MAX_NEW = 20  # more than the smallest announced block (14): blocks and the tokens after one both run


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return restore_model(smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny"))


def _examples(target, data, fmt):
    with jax.set_mesh(target.mesh):
        examples, family, available = eval_workdir.load_examples(
            fmt, data, target.workdir, checkpoint.tokenizer_dir(target.workdir), target.fingerprint, {})
    assert family == "vflash" and len(examples) == available
    return examples


@pytest.mark.heavy
@pytest.mark.parametrize("data,fmt,records", [(SMOKE / "recipe.json", "recipe", 96), (SMOKE / "eval.jsonl", "vflash", 16)])
def test_a_random_drafter_is_lossless_on_every_smoke_record(target, data, fmt, records):
    examples = _examples(target, data, fmt)
    assert len(examples) == records
    mine = list(range(len(examples)))
    calls = AtomicCalls(target.tokenizer)
    own = speculative.own_prompts(examples, mine, target)
    through_call = speculative.call_prompts(examples, mine, target, calls)
    assert len(through_call) >= records // 2  # the trajectory records (points and boxes announce no block)
    vocab, eot = len(target.tokenizer), end_of_turn_id(target.tokenizer)
    drafted = 0
    for answer in [*own, *through_call]:
        reference = generate_ids(target.params, target.graphdef, [answer.prompt], max_new_tokens=MAX_NEW,
                                 stop_ids=(eot,), vocab=vocab)[0]
        decoder = SpeculativeDecoder(target.graphdef, target.params, calls=calls, vocab=vocab, stop_ids=(eot,))
        out = decoder.generate(dict(answer.prompt), RandomDrafter(vocab),
                               max_new_tokens=MAX_NEW, seed=answer.index)
        assert [int(t) for t in out] == [int(t) for t in np.asarray(reference)], f"record {answer.index} ({answer.entry})"
        drafted += decoder.stats.passes
        assert sum(decoder.stats.histogram.values()) == decoder.stats.passes
    # Every through-the-call prompt announces its block: each drafted at least one pass.
    assert drafted >= len(through_call)
