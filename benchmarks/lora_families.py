"""A LoRA smoke run per model family (issue 29): a tiny random checkpoint of each family, written by
transformers with a BPE tokenizer trained on the bundled data, fine-tuned with `:hf,lora` on the bundled
smoke data by `python -m valen_jax.train` as a user runs it; the first and last logged losses per family.

    .venv/bin/python benchmarks/lora_families.py [--steps=12] [--families=qwen2,qwen3,llama,qwen2_5_vl]

Text families train `configs/chat.py:hf,lora` on data/smoke/chat (tool calls included); Qwen2.5-VL trains
`configs/vflash.py:hf,lora` on data/smoke/vflash (images through the imported tower, which stays frozen).
Last line: `lora_loss_falling=K/N qwen2=FIRST->LAST ...` (K: the families whose last loss is below the first).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = {  # transformers config class, its family-specific fields
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
}
FAMILIES = (*TEXT, "qwen2_5_vl")


def text_checkpoint(family: str, directory: Path) -> None:
    """A tiny random `family` decoder with a ChatML BPE tokenizer trained on the chat smoke data."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data_pipeline.chat_templates import CHATML

    texts = [json.dumps(json.loads(line)) for line in (ROOT / "data/smoke/chat/train.jsonl").read_text().splitlines()]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    name, extra = TEXT[family]
    config = getattr(transformers, name)(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def run(family: str, home: Path, steps: int) -> tuple[float, float]:
    base = home / f"{family}-base"
    if family == "qwen2_5_vl":
        from tests.vl_checkpoints import make_vl_checkpoint
        make_vl_checkpoint(base, family)
        config, extra = "configs/vflash.py:hf,lora", ["--config.data.seq_len=512", "--config.model.remat=none"]
    else:
        text_checkpoint(family, base)
        config, extra = "configs/chat.py:hf,lora", ["--config.data.seq_len=512"]
    workdir = home / family
    command = [sys.executable, "-m", "valen_jax.train", f"--config={config}", f"--workdir={workdir}",
               f"--config.model.init_from={base}", f"--config.data.tokenizer={base}",
               f"--config.train.steps={steps}", "--config.train.log_every=1", f"--config.train.checkpoint_every={steps}",
               "--config.train.warmup_steps=1", "--config.train.learning_rate=1e-2", "--config.model.dtype=float32",
               "--config.model.lora.rank=8", "--config.data.global_batch=4", "--config.eval.every=0",
               "--config.eval.at_end=False", *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{family}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    losses = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    print(f"{family}: {' '.join(command[1:])}\n  loss per step: {' '.join(f'{x:.3f}' for x in losses)}", flush=True)
    return losses[0], losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}")
    with tempfile.TemporaryDirectory() as home:
        results = {family: run(family, Path(home), args.steps) for family in families}
    falling = sum(last < first for first, last in results.values())
    print(f"lora_loss_falling={falling}/{len(results)} "
          + " ".join(f"{family}={first:.3f}->{last:.3f}" for family, (first, last) in results.items()))


if __name__ == "__main__":
    main()
