"""The programs besides the train step that a run of a config compiles, lowered from abstract inputs:
the evaluation forward and the decoding programs, each the library's own jitted function (never a copy).

- `eval_forward`: `evaluation.tokens`' teacher-forced row sums (periodic evaluation and `evaluate`'s
  loss; token data only, Valen's branch scoring is not compiled yet) at the evaluation batch (`eval.batch_size`, rounded up as `evaluation.workdir.local_batch_size`
  does to split over the batch-sharded devices);
- `generate`: `decoding.engine`'s whole generation of one batch at that batch: the prefill, then the
  `while_loop` of decode steps, prompts of `data.seq_len` tokens and `eval.max_new_tokens` new ones
  (bucketed as the engine buckets them);
- `spec_answer`: `decoding.loop`'s speculative program at that batch: the prefill that also builds the
  drafter's state, then the one `while_loop` of whole answers (decode steps outside announced blocks,
  draft → verify with `extend` → accept inside them, announcements found on the device). The drafter
  is the config's VFlash drafter (`model.drafter`; its parameters abstract too), else the scripted
  oracle (`ScriptRule`), whose drafting is a slice. The announcement tables are abstract too, at a
  nominal 128 token classes (a tokenizer's own count is in the tens: a few KiB either way).

A reinforcement run (`train.mode=reinforce`; its train step is the update on rollout-time old
log-probabilities) adds the two programs each of its steps runs besides:
- `rollout`: the engine's generation of one rollout: rl.prompts_per_rollout prompts of the longest prompt
  (data.seq_len - rl.max_new_tokens tokens, bucketed), each prefilled once and sampled rl.group_size
  times (`engine_program`'s group) with the run's sampling; on the per-layer copy of a scanned policy, as
  the run decodes (`transformer.PerLayer`);
- `first_update`: a rollout's first update, which makes the old log-probabilities from its own forward.

The parameters are the train state's (their dtype and shardings, as a restored workdir holds them). The
programs that decode (`generate`, `spec_answer`, `rollout`) read a scanned model's weights as the runs do:
the per-layer copy (`transformer.PerLayer`: `run.handle.decoding_layout` for generate and evaluation, the
reinforcement task's split for rollouts), laid out as the unscanned model's logical axes say; compiling them
over the stacked layout measured a program no run executes (a v5e counts ~1.5x its bytes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from valen_jax.decoding import announcements, engine, loop
from valen_jax.decoding.draft_rules import ScriptRule, TrainedRule
from valen_jax.evaluation.tokens import _row_sums_fn
from valen_jax.evaluation.workdir import local_batch_size
from valen_jax.models import sharding
from valen_jax.models.drafter import DrafterConfig, abstract_drafter
from valen_jax.models.transformer import PerLayer
from valen_jax.tasks.reinforce import MODE as REINFORCE
from valen_jax.training.step import TrainLayout


def _abstract(shape, dtype, sharding_):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_)


def decode_batch(config, mesh) -> int:
    return local_batch_size(int(config.eval.batch_size), mesh) * jax.process_count()


def programs(config, task, layout: TrainLayout, assembly, spec):
    """(name, thunk) per program: each thunk lowers and compiles it for `layout.mesh` (under the mesh, so
    target-dependent choices read the slice) and returns the compiled executable. Thunks run in order:
    each compiles on its own."""
    mesh, model_cfg = layout.mesh, task.model_cfg
    params = _abstract_params(layout)
    decoding = _decoding_layout(config, model_cfg, layout)
    decode_params = _abstract_params(decoding)
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = decode_batch(config, mesh)

    def batched(shape, dtype):
        return _abstract(shape, dtype, sharding.batch_sharding(mesh, len(shape)))

    def one(shape, dtype):
        return _abstract(shape, dtype, replicated)

    def compiled(fn, *args):
        with jax.set_mesh(mesh):
            return fn.lower(*args).compile()

    def eval_forward():
        shapes = assembly.batch_shapes(spec, rows)
        batch = {k: batched(v.shape, v.dtype) for k, v in shapes.items()}
        return compiled(_row_sums_fn(layout.graphdef), params, batch)

    seq_len, new = int(config.data.seq_len), int(config.eval.max_new_tokens)
    mrope = model_cfg.mrope_section is not None
    vision = model_cfg.vision is not None and int(config.data.max_patches) > 0
    patches = int(config.data.max_patches)

    def prompt_inputs(make, batch: int, length: int):
        positions = make((batch, length, 3) if mrope else (batch, length), jnp.int32)
        media = ((make((batch, patches, model_cfg.vision.patch_dim), jnp.float32),
                  make((batch, patches, 3), jnp.int32), make((batch, patches), jnp.int32)) if vision else None)
        return make((batch, length), jnp.int32), positions, make((batch,), jnp.int32), media

    def generate():
        fn = loop.engine_program(decoding.graphdef, engine.GREEDY, model_cfg.vocab_size,
                                 engine.bucket(seq_len + new), engine.bucket(new))
        tokens, positions, lengths, media = prompt_inputs(batched, rows, engine.bucket(seq_len))
        return compiled(fn, decode_params, tokens, positions, lengths, batched((rows,), jnp.int32),
                        batched((rows,), jnp.bool_), media, one((1,), jnp.int32), one((), jnp.uint32),
                        batched((rows,), jnp.uint32), one((), jnp.int32))

    rule, draft_params = _drafter(config, model_cfg, mesh, replicated, new)

    def spec_answer():
        width = rule.block_size or 32  # SpeculativeDecoder's default width for a drafter without a size
        start, _ = loop.speculative_programs(decoding.graphdef, rule, engine.GREEDY, model_cfg.vocab_size, width,
                                             engine.bucket(seq_len + new), engine.bucket(new + width + 1))
        tokens, positions, lengths, media = prompt_inputs(batched, rows, engine.bucket(seq_len))
        states = announcements.states()
        tables = announcements.Tables(one((model_cfg.vocab_size,), jnp.int32), one((128, states), jnp.int32),
                                      one((128, states, 2), jnp.int32), one((128, states, 2), jnp.int32),
                                      *(one((), jnp.int32) for _ in range(4)),
                                      # The spelling's drafts: 13 tokens after <tool_call> in Qwen's and our
                                      # tokenizer's encoding; 16 leaves room for a tokenizer that splits more.
                                      one((states, 16), jnp.int32), one((states,), jnp.int32))
        return compiled(start, decode_params, draft_params, tokens, positions, lengths, batched((rows,), jnp.int32),
                        batched((rows,), jnp.int32), batched((rows,), jnp.bool_), media, one((1,), jnp.int32),
                        one((), jnp.uint32), batched((rows,), jnp.uint32), batched((rows,), jnp.int32), tables)

    # Valen's evaluation scores branch trees (`evaluation.valen`), not the token sums: not compiled here yet.
    forward = [] if config.data.format == "valen" else [("eval_forward", eval_forward)]
    reinforce = (_reinforce_programs(config, task, layout, decoding, compiled, batched, one)
                 if config.train.mode == REINFORCE else [])
    return forward + [("generate", generate), ("spec_answer", spec_answer)] + reinforce


def _abstract_params(layout: TrainLayout):
    return jax.tree.map(lambda s, sh: _abstract(s.shape, s.dtype, sh), layout.param_shapes, layout.param_shardings)


def _decoding_layout(config, model_cfg, layout: TrainLayout) -> TrainLayout:
    """The layout the decoding programs read: a scanned model's unscanned twin (`PerLayer`'s config, its
    shardings from the unscanned logical axes), else the train layout itself."""
    if not model_cfg.scan_layers:
        return layout
    return TrainLayout.from_config(PerLayer(model_cfg, layout.mesh).cfg, config.train, layout.mesh)


def _reinforce_programs(config, task, layout: TrainLayout, decoding: TrainLayout, compiled, batched, one):
    """A reinforcement step's rollout (on the `decoding` layout) and first update (module docstring)."""
    rl, model_cfg = config.rl, task.model_cfg
    prompts, group, new = int(rl.prompts_per_rollout), int(rl.group_size), int(rl.max_new_tokens)
    longest = int(config.data.seq_len) - new  # `rows.PromptShape`: the longest prompt a rollout reads
    prompt = engine.bucket(longest)
    params = _abstract_params(decoding)

    def rollout():
        fn = loop.engine_program(decoding.graphdef, task.sampling(), len(task.setup.tokenizer),
                                 engine.bucket(longest + new), engine.bucket(new), group)  # as generate_ids
        positions = (prompts, prompt, 3) if model_cfg.mrope_section is not None else (prompts, prompt)
        return compiled(fn, params, batched((prompts, prompt), jnp.int32), batched(positions, jnp.int32),
                        batched((prompts,), jnp.int32), batched((prompts,), jnp.int32), batched((prompts,), jnp.bool_),
                        None, one((1,), jnp.int32), one((), jnp.uint32), batched((prompts * group,), jnp.uint32),
                        one((), jnp.int32))

    return [("rollout", rollout), ("first_update", lambda: task.compile_first_update(layout))]


def _drafter(config, model_cfg, mesh, replicated, new: int):
    """The block loop's device drafter: the config's VFlash drafter (abstract parameters, sharded by the
    rules table as `vflash` training lays them out), else the scripted oracle over `new` tokens."""
    group = config.model.drafter
    if group is None:
        return ScriptRule(), _abstract((new,), jnp.int32, replicated)
    cfg = DrafterConfig.of(group, model_cfg)
    graphdef, abstract = abstract_drafter(cfg)
    shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
    params = jax.tree.map(lambda s, sh: _abstract(s.shape, s.dtype, sh), nnx.to_pure_dict(abstract), shardings)
    return TrainedRule(graphdef, tuple(cfg.target_layers), cfg.block_size, int(model_cfg.vocab_size)), params
