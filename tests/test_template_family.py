"""`data.template_family="auto"` (the default): a hub checkpoint's tokenizer trains with the family its own chat
template writes, so a Llama 3.x user sets no key that a Qwen user does not (issue 54: the README's four keys)."""

from __future__ import annotations

import pytest

from data_pipeline.chat_templates import LLAMA3, TRAINING_TEMPLATES
from data_pipeline.tokenizer import TokenizerError, checkpoint_chat_template, load_tokenizer
from tests.hub_checkpoints import build_tokenizer, chat_template

EXPECTED = {"qwen2_5": "chatml", "qwen3": "chatml", "llama3_1": "llama3", "llama3_2": "llama3",
            "qwen2_5_vl": "chatml", "qwen3_vl": "chatml"}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_auto_installs_the_family_the_hub_template_writes(tmp_path, family):
    build_tokenizer(tmp_path, family)
    tokenizer = load_tokenizer(tmp_path, "auto")
    assert tokenizer.chat_template == TRAINING_TEMPLATES[EXPECTED[family]]
    assert checkpoint_chat_template(tokenizer) == chat_template(family)  # kept for the export


def test_a_template_of_no_known_family_is_refused_naming_the_key(tmp_path):
    tokenizer = build_tokenizer(tmp_path, "llama3_1")
    # A Llama vocabulary under a template that writes neither family's end of turn: the vocabulary alone
    # decides (only Llama's control tokens are there).
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path, "auto").chat_template == LLAMA3
    # ChatML's tokens added too: nothing tells the two apart.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(TokenizerError, match=r"config\.data\.template_family"):
        load_tokenizer(tmp_path, "auto")


def test_a_marked_template_is_kept_under_auto():
    from configs import common

    tokenizer = load_tokenizer(common.ROOT / "data/tokenizer", "auto")
    assert checkpoint_chat_template(tokenizer) is None  # nothing replaced: the smoke tokenizer's marks its spans


def test_a_tokenizer_without_a_pad_token_fills_rows_with_its_eos(tmp_path):
    """Llama 3.x ships no pad token: rows are filled with the eos id (no loss or attention reads filler), where
    RowSpec used to stop the run with a TypeError on `int(None)`."""
    from data_pipeline.tokenizer import filler_id

    build_tokenizer(tmp_path, "llama3_1")
    tokenizer = load_tokenizer(tmp_path, "auto")
    assert tokenizer.pad_token_id is None
    assert filler_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|eot_id|>")
