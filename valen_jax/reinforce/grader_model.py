"""A workdir's model as the grader of `reinforce.grader` (seed 003: "To use it as a model: grader, specify
graderInstructions"; "Graders receive text"): each conversation is rendered with the grader's own chat
template, answered greedily by the decode engine in one batched call, and decoded to text.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.decoding.engine import generate_ids
from valen_jax.evaluation.tokens import decode
from valen_jax.run import decoding_layout, restore_model


def workdir_grader(workdir: str | Path, max_new_tokens: int, mesh):
    """`generate(conversations) -> answers` of `workdir`'s latest checkpoint, laid out on `mesh`."""
    grader = decoding_layout(restore_model(Path(workdir), mesh=mesh))
    tokenizer, eot = grader.tokenizer, end_of_turn_id(grader.tokenizer)

    def generate(conversations: list[list[dict]]) -> list[str]:
        prompts = []
        for conversation in conversations:
            ids = np.asarray(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False),
                             np.int32)
            prompts.append({"ids": ids, "positions": np.arange(len(ids), dtype=np.int32)})
        with jax.set_mesh(mesh):
            answers = generate_ids(grader.params, grader.graphdef, prompts, max_new_tokens=max_new_tokens,
                                   stop_ids=(eot,), vocab=len(tokenizer), mesh=mesh, local_batch=len(prompts))
        return [decode(tokenizer, ids, eot) for ids in answers]

    return generate
