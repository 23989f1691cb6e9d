"""The README's loading recipe for our two exports, as a user runs it in transformers and PEFT.

`merged_and_adapter_logits(model_class, base, merged, adapter, ids)` → (merged logits, adapter logits), numpy f32:
the merged export loaded whole, and the base checkpoint resized to the adapter folder's tokenizer
(`resize_token_embeddings(len(tokenizer))`, new rows drawn as transformers draws them) with
`PeftModel.from_pretrained(base, adapter)`. The merged export pads its vocabulary (to a multiple of 128), so its
logits may be wider than the adapter's; callers compare the tokenizer's ids."""

from __future__ import annotations


def merged_and_adapter_logits(model_class, base, merged, adapter, ids):
    import peft
    import torch
    import transformers

    vocabulary = len(transformers.AutoTokenizer.from_pretrained(adapter))
    with torch.no_grad():
        want = model_class.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
        model = model_class.from_pretrained(base, dtype=torch.float32)
        model.resize_token_embeddings(vocabulary)
        got = peft.PeftModel.from_pretrained(model, adapter).eval()(input_ids=ids).logits
    return want.numpy(), got.numpy()
