"""Valen scoring: question mode as one branch tree against each candidate as a separate sequence.

    .venv/bin/python benchmarks/valen_scoring.py                # ~300-token states, 8 candidates, CPU
    .venv/bin/python benchmarks/valen_scoring.py --records=64 --dim=1024 --layers=8 --mlp=2816  # bigger

The same generated Valen records (one `choice` question, 8 candidates of about 10 tokens, a state
of about 300 tokens) are validated and rendered by `data_pipeline` (read_valen, ValenRenderer)
with the smoke tokenizer, assembled by `valen_jax.data.valen_rows.valen_row` in `question` mode
(DESIGN, "Question mode as a branch tree": the state once, each branch attending to the state
and itself, positions restarting after it), and scored by a small random decoder with the score
head (`Transformer.hidden` + `ScoreHead` + `branch_log_probs`) in one jitted forward per batch.
The separate sequences are the state followed by one branch (the same tokens as that branch in
the tree row), one row each, through the same jitted model. Both are compiled before timing.

Printed: the rows' shapes, records/s of both, the largest difference between the two sets of
branch log-probabilities and of raw scores (asserted ≤ 1e-5), and last
`branch_tree_speedup=X` (tree records/s over separate records/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data_pipeline.formats.valen import read_valen
from data_pipeline.render.valen import ValenRenderer
from data_pipeline.tokenizer import load_tokenizer
from valen_jax.data.assemble import RowSpec
from valen_jax.data.valen_rows import QuestionSpec, row_needs, valen_row
from valen_jax.models.config import ModelConfig, padded_vocab
from valen_jax.models.heads import branch_log_probs
from valen_jax.models.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("red green blue light street car stop walk child stove water handle counter kitchen door open "
         "closed window rain road sign left right near far small large quick slow warm cold wet dry "
         "person table chair floor wall lamp box bag phone key shoe coat hat cup plate").split()
ATTENTION_ROUND = 64  # rows padded to a multiple of the decoder's attention block


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="records per tree batch (separate: 8x the rows)")
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--state-words", type=int, default=130, help="~300 state tokens")
    parser.add_argument("--candidate-words", type=int, default=3, help="~10 candidate tokens")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def write_records(path: Path, args) -> None:
    """Text-only Valen records: one `choice` question each, `--candidates` criteria."""
    rng = np.random.default_rng(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    with open(path, "w") as f:
        for i in range(args.records):
            criteria = {f"c{k}": words(args.candidate_words) for k in range(args.candidates)}
            probabilities = dict.fromkeys(criteria, 0.0) | {"c0": 1.0}
            record = {
                "group_id": f"bench-{i:04d}",
                "request": {"state": words(args.state_words) + ".",
                            "questions": {"what": {"type": "choice", "instructions": "Choose one.",
                                                   "criteria": criteria}}},
                "targets": {"what": {"probabilities": probabilities}},
                "assets": [],
                "meta": {"record_id": f"bench-{i:04d}", "domain": "bench", "modality": "text",
                         "language_bucket": "en"},
            }
            f.write(json.dumps(record) + "\n")


def round_up(n: int) -> int:
    return -(-n // ATTENTION_ROUND) * ATTENTION_ROUND


def tree_rows(examples, tokenizer, cfg, candidates: int):
    """question-mode rows from the project's assembly, padded to the longest record (rounded)."""
    qspec = QuestionSpec("question", 1, candidates, training=False)
    probe = RowSpec.of(1 << 16, 0, tokenizer, cfg, {})
    seq_len = round_up(max(row_needs(e, probe, qspec).seq_len for e in examples))
    spec = RowSpec.of(seq_len, 0, tokenizer, cfg, {})
    return [valen_row(e, spec, qspec, None) for e in examples], spec


def separate_rows(row: dict, seq_len: int) -> list[dict]:
    """State + one branch per row, for every branch of a tree row: the same tokens, positions 0…n-1."""
    valid = row["segment_ids"] > 0
    state = np.flatnonzero(valid & (row["branch_ids"] == 0))
    rows = []
    for k in np.flatnonzero(row["branch_mask"][0]):
        branch = row["branch_ids"][row["score_positions"][0, k]]
        members = np.flatnonzero(valid & (row["branch_ids"] == branch))
        tokens = np.concatenate([row["tokens"][state], row["tokens"][members]])
        pad = seq_len - len(tokens)
        rows.append({"tokens": np.pad(tokens, (0, pad)),
                     "positions": np.pad(np.arange(len(tokens), dtype=np.int32), (0, pad)),
                     "segment_ids": np.pad(np.ones(len(tokens), np.int32), (0, pad)),
                     "score_position": np.int32(len(tokens) - 1)})
    return rows


def stack(rows: list[dict], keys) -> dict:
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in keys}


def main() -> None:
    args = parse_args()
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    cfg = ModelConfig(vocab_size=padded_vocab(len(tokenizer)), dim=args.dim, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.dim // args.heads,
                      mlp_dim=args.mlp, score_head=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        write_records(path, args)
        renderer = ValenRenderer(tokenizer)
        examples = [renderer.render(r, "bench") for r in read_valen(path)]
    trees, spec = tree_rows(examples, tokenizer, cfg, args.candidates)
    candidate_lens = [int(n) for e in examples for n in np.diff(e.arrays["candidate_offsets"])]
    state_lens = [int(((t["branch_ids"] == 0) & (t["segment_ids"] > 0)).sum()) for t in trees]
    branch_lens = [int((t["branch_ids"] == b).sum()) for t in trees for b in range(1, args.candidates + 1)]
    separate_len = round_up(max(state_lens) + max(branch_lens))
    separates = [separate_rows(t, separate_len) for t in trees]
    print(f"records={len(trees)}: state tokens {min(state_lens)}-{max(state_lens)}, {args.candidates} candidates "
          f"of {min(candidate_lens)}-{max(candidate_lens)} tokens, branches of {min(branch_lens)}-{max(branch_lens)} "
          "tokens (instructions + candidate + suffix)")
    print(f"tree rows [{args.batch}, {spec.seq_len}] vs separate rows [{args.batch * args.candidates}, "
          f"{separate_len}] per batch of {args.batch} records; model dim={cfg.dim} layers={cfg.num_layers} "
          f"heads={cfg.num_heads}/{cfg.num_kv_heads} mlp={cfg.mlp_dim} vocab={cfg.vocab_size}")

    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))

    @jax.jit
    def score_tree(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"],
                              branch_ids=batch["branch_ids"])
        scores = model.score_head(hidden)
        raw = jnp.take_along_axis(scores, batch["score_positions"].reshape(scores.shape[0], -1), axis=1)
        return raw, branch_log_probs(scores, batch["score_positions"], batch["branch_mask"])[:, 0]

    @jax.jit
    def score_separate(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
        scores = model.score_head(hidden)
        return jnp.take_along_axis(scores, batch["score_position"][:, None], axis=1)[:, 0]

    tree_keys = ("tokens", "positions", "segment_ids", "branch_ids", "score_positions", "branch_mask")
    separate_keys = ("tokens", "positions", "segment_ids", "score_position")
    starts = range(0, len(trees) - args.batch + 1, args.batch)
    tree_batches = [stack(trees[s:s + args.batch], tree_keys) for s in starts]
    separate_batches = [stack([r for rows in separates[s:s + args.batch] for r in rows], separate_keys)
                        for s in starts]
    records = len(tree_batches) * args.batch

    def run_tree():
        return [jax.block_until_ready(score_tree(params, b)) for b in tree_batches]

    def run_separate():
        return [jax.block_until_ready(score_separate(params, b)) for b in separate_batches]

    started = time.perf_counter()
    tree_out, separate_out = run_tree(), run_separate()  # compile (one shape each) and check
    print(f"compiled both in {time.perf_counter() - started:.1f}s")

    tree_raw = np.concatenate([np.asarray(raw) for raw, _ in tree_out])  # [R, K]
    tree_log_probs = np.concatenate([np.asarray(lp) for _, lp in tree_out])
    separate_raw = np.concatenate([np.asarray(x) for x in separate_out]).reshape(records, args.candidates)
    separate_log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(separate_raw), axis=-1))
    raw_diff = float(np.abs(tree_raw - separate_raw).max())
    log_prob_diff = float(np.abs(tree_log_probs - separate_log_probs).max())
    print(f"max |score difference| = {raw_diff:.2e}, max |branch log-prob difference| = {log_prob_diff:.2e}")
    assert raw_diff <= 1e-5 and log_prob_diff <= 1e-5, "the branch tree does not score like separate sequences"

    # Alternating repeats, so machine noise hits both alike; the median of each.
    tree_times, separate_times = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        run_tree()
        tree_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        run_separate()
        separate_times.append(time.perf_counter() - started)
    tree_rate = records / statistics.median(tree_times)
    separate_rate = records / statistics.median(separate_times)
    tree_tokens = args.batch * spec.seq_len
    separate_tokens = args.batch * args.candidates * separate_len
    print(f"question mode (branch tree): {tree_rate:8.1f} records/s  ({tree_tokens} row tokens per batch)")
    print(f"separate sequences:          {separate_rate:8.1f} records/s  ({separate_tokens} row tokens per batch)")
    print(f"branch_tree_speedup={tree_rate / separate_rate:.2f}")


if __name__ == "__main__":
    main()
