"""Issue 32's comparison: the same tiny model and task trained by reinforcement under TRL's `GRPOTrainer`
and under ours (train.mode=reinforce), from the same weights; reward after N updates and updates per
second side by side.

    python benchmarks/reinforce.py --out /tmp/rlb --sft /tmp/rl-sft250 --updates 40 --seeds 3
    python benchmarks/reinforce.py --out /tmp/rlb-small --sft-steps 10 --updates 3 --prompts 4 --group 4 --seeds 2

The start: `configs/reinforce.py:sft` trained supervised (or an existing workdir, `--sft=WORKDIR`),
exported by `python -m valen_jax.export` (a Llama-family text checkpoint with the training tokenizer and
chat template); TRL loads that with `AutoModelForCausalLM.from_pretrained`, ours starts from the workdir
(`--config.rl.from_workdir`): the same weights. Both read the settings of `configs/reinforce.py` (so they
cannot drift apart): G completions per prompt (num_generations), P prompts per update, max completion
length, temperature 1 (top_p 1, no top_k), the clip range, no KL (TRL beta=0, our kl_coef=0), std-scaled
group advantages (TRL scale_rewards="group", our scale_by_std), the token-level loss normalisation (TRL
loss_type="dapo", ours is DAPO's), `inner_steps` optimizer steps per rollout batch with the old
log-probabilities kept from rollout time (TRL num_iterations), AdamW with the config's learning rate,
betas, weight decay and gradient clip, warmup then constant. The reward is ours on both sides:
`valen_jax.reinforce.rewards.exact` (evaluate's `answer_matches`), called from TRL's reward function with
the row's assistant message as the gold answer.

Where the two differ: TRL shuffles prompts with its own sampler, ours reads the Grain pipeline's order
(different prompts, same distribution); sampling randomness differs (torch vs the engine's keys); TRL
applies weight decay to all but bias/norm parameters by name, ours by `optim._decay_mask` (the same set
here: the matrices); TRL divides by the Bessel-corrected group std + 1e-4, ours by the population std +
1e-6 (a constant factor sqrt(G/(G-1)) on every advantage, which Adam's normalisation absorbs); TRL runs
in PyTorch eager on CPU with `model.generate`, ours compiles the decode and the update with XLA.

Seeds: each side runs `--seeds K` times from the same start, seeds train.seed .. train.seed+K-1 (ours:
`--config.train.seed`, which draws our prompt order and the rollouts' keys; TRL: its `seed`), one seed of
each side after the other so the machine's load falls on both alike. Per side: the mean over seeds of
the reward after N updates with its standard error (Bessel-corrected std / sqrt(K)), and the median of
the updates per second; X is the ratio of the mean rewards, Y of the median rates. Each run's result is
saved under OUT/results/; `--resume` reuses those of an earlier run with the same settings.

Counted: one *update* is one rollout batch (P·G completions sampled and rewarded) and its `inner_steps`
optimizer steps: our loop's step, TRL's `num_iterations` global steps. Updates per second are measured
from the end of update 1 to the end of update N (the first holds compilation and warm-up on both
sides), divided by N − 1; model load, export and the final evaluation are outside. Reward after N
updates: the mean reward of the sampled completions over the last `--last` rollouts (each side's own
rollouts, temperature 1). Eval: `answer_exact_match` on the 200 eval prompts, greedy, 8 new tokens (ours:
the run's end-of-run `evaluate` report; TRL: `generate` greedy scored by the same `exact`).

Last line: `reinforce_reward_vs_trl=X steps_per_s_vs_trl=Y` (ours / TRL).

Measured on an idle host (2026-12-04, load 0.1-1.3 before each run, nothing else running; JAX 1 CPU
device, torch 2 threads), from a fresh `:sft` start (p0 0.215), at commit 3884599 (the update projects
only the completion window; a rollout prefills each prompt once for its group):

    python benchmarks/reinforce.py --out /tmp/rl-bench8 --sft /tmp/rl-sft250 --updates 40 --seeds 6   # ~17 min

Reward over the last 10 rollouts: ours 0.190 / 0.186 / 0.197 / 0.204 / 0.204 / 0.205 (mean 0.198, s.e.
0.003), TRL 0.209 / 0.187 / 0.199 / 0.193 / 0.201 / 0.232 (0.204, s.e. 0.007); updates/s median ours 1.187
(1.18-1.22), TRL 0.458 (0.45-0.48); eval answer_exact_match mean ours 0.247, TRL 0.243. Last line
`reinforce_reward_vs_trl=0.972 steps_per_s_vs_trl=2.593` (seeds 0-2 alone: 0.964 / 2.589): the speed goal
met, the reward goal not as measured (within one standard error of the difference). Six more seeds
(`--seeds 12 --resume`, same out; seeds 6-8 and TRL's 11 on a host shared with tests, which slows their rates
only): ours 0.196 / 0.205 / 0.194 / 0.189 / 0.200 / 0.217, TRL 0.191 / 0.185 / 0.183 / 0.204 / 0.215 / 0.186;
over 12 seeds ours 0.1990 (s.e. 0.0025), TRL 0.1987 (0.0042), eval 0.238 vs 0.236, last line
`reinforce_reward_vs_trl=1.001 steps_per_s_vs_trl=2.662`: the reward goal met as measured (± 0.025). Before those two
changes, the 3-seed command on the same idle host gave `reinforce_reward_vs_trl=0.967
steps_per_s_vs_trl=1.425` (ours 0.566 updates/s), then 0.964 / 2.012 with the completion window alone.

Earlier, on a loaded host (2 CPU cores shared with other engineers' jobs: load average 2.4 at the
start, 7-8 throughout, 5.9 / 7.2 / 7.9 over 1 / 5 / 15 min at the end; JAX 1 CPU device, torch 2 threads), at commit 0c43a35,
from that session's `:sft` run of the README's command (p0 = 0.245):

    python benchmarks/reinforce.py --out /tmp/rl-bench3 --sft /tmp/rl-sft250 --updates 40 --seeds 3

N = 40 updates of P 64 prompts × G 8, 5 new tokens, temperature 1, 2 optimizer steps each, lr 5e-4;
seeds 0 / 1 / 2. Reward over the last 10 rollouts: ours 0.194 / 0.174 / 0.200, mean 0.189 (s.e. 0.008);
TRL 0.217 / 0.171 / 0.192, mean 0.193 (s.e. 0.013). Updates/s: ours 0.174 / 0.199 / 0.176 (median
0.176), TRL 0.063 / 0.053 / 0.066 (median 0.063). Eval answer_exact_match: ours 0.190 / 0.195 / 0.190,
TRL 0.230 / 0.205 / 0.215. Last line `reinforce_reward_vs_trl=0.980 steps_per_s_vs_trl=2.782`: the speed
goal (≥ 1.5) met; the reward goal (≥ 1.0) not met as measured, X = 0.980 ± 0.079 (the two standard
errors propagated): a gap of 0.004 of reward against a seed-to-seed spread of 0.05, so three seeds per
side cannot tell the two apart. The earlier single-seed run (from a p0 = 0.215 start) gave 0.984 / 3.33.
At temperature 1 the later change of the policy's log-probabilities to the sampler's (padding rows left
out of the normaliser) moves them by the padding rows' mass, 2e-5 on average at this start: not
re-measured.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CONFIG = "configs/reinforce.py"


def settings(prompts: int | None, group: int | None, max_new_tokens: int | None) -> dict:
    """The comparison's shared settings, read from configs/reinforce.py (overridden by the flags)."""
    from configs.reinforce import get_config

    config = get_config("")
    rl, train = config.rl, config.train
    if list(rl.rewards) != ["exact"] or float(rl.kl_coef) != 0.0:
        raise SystemExit(f"{CONFIG}: the comparison reproduces rewards={{'exact': 1}} and kl_coef=0 only")
    return {"prompts": prompts or int(rl.prompts_per_rollout), "group": group or int(rl.group_size),
            "max_new_tokens": max_new_tokens or int(rl.max_new_tokens), "temperature": float(rl.temperature),
            "top_p": float(rl.top_p), "clip": float(rl.clip_epsilon), "inner": int(rl.inner_steps),
            "scale_by_std": bool(rl.scale_by_std), "lr": float(train.learning_rate),
            "warmup": int(train.warmup_steps), "end_fraction": float(train.end_learning_rate_fraction),
            "b1": float(train.adam_b1), "b2": float(train.adam_b2), "weight_decay": float(train.weight_decay),
            "grad_clip": float(train.grad_clip_norm), "seed": int(train.seed),
            "train": str(config.data.train), "eval": str(config.data.eval),
            "eval_new_tokens": int(config.eval.max_new_tokens), "eval_examples": int(config.eval.max_examples)}


def _train(workdir: Path, variant: str, *overrides: str) -> None:
    command = [sys.executable, "-m", "valen_jax.train", f"--config={CONFIG}{variant}", f"--workdir={workdir}",
               *overrides]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def prepare_start(out: Path, sft: Path | None, sft_steps: int) -> tuple[Path, Path]:
    """(the SFT workdir, its Hugging Face export)."""
    if sft is None:
        sft = out / "sft"
        _train(sft, ":sft", f"--config.train.steps={sft_steps}", f"--config.train.checkpoint_every={sft_steps}",
               "--config.eval.at_end=False")
    hf_dir = out / "hf"
    command = [sys.executable, "-m", "valen_jax.export", f"--workdir={sft}", f"--output={hf_dir}"]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return sft, hf_dir


def run_ours(out: Path, sft: Path, s: dict, updates: int, evaluate: bool, seed: int) -> dict:
    workdir = out / f"ours-seed{seed}"
    if workdir.exists():  # a run cut short would resume there, and its timings would cover only the rest
        shutil.rmtree(workdir)
    # train.seed draws both our prompt order (the Grain shuffle) and the rollouts' sampling keys, as TRL's
    # seed draws its sampler's order and torch's sampling.
    _train(workdir, "", f"--config.rl.from_workdir={sft}", f"--config.train.steps={updates}",
           f"--config.train.checkpoint_every={updates}", "--config.train.log_every=1", f"--config.train.seed={seed}",
           f"--config.rl.prompts_per_rollout={s['prompts']}", f"--config.data.global_batch={s['prompts']}",
           f"--config.rl.group_size={s['group']}", f"--config.rl.max_new_tokens={s['max_new_tokens']}",
           f"--config.eval.at_end={evaluate}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward/mean" in r]
    if [r["step"] for r in records] != list(range(1, updates + 1)):
        raise RuntimeError(f"{workdir}/metrics.jsonl: expected one record per update 1..{updates}")
    # step_time_s of step k (log_every=1) is the wall time from the end of step k-1 to the end of step k.
    seconds = sum(r["step_time_s"] for r in records[1:])
    result = {"rewards": [r["reward/mean"] for r in records], "seconds_after_first": seconds}
    if evaluate:
        result["eval"] = json.loads((workdir / "eval" / f"report-{updates}.json").read_text())["answer_exact_match"]
    return result


def _chat_rows(path: str) -> list[dict]:
    """{"prompt": the messages before each assistant message, "answer": that message's text} per message."""
    rows = []
    for line in Path(path).read_text().splitlines():
        messages = json.loads(line)["messages"]
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                rows.append({"prompt": messages[:index], "answer": message["content"]})
    return rows


def exact_reward(prompts, completions, answer, **_) -> list[float]:
    """TRL's reward function: our registry's `exact` against the row's assistant message."""
    from valen_jax.reinforce.rewards import exact

    return [exact(c[0]["content"] if isinstance(c, list) else c, {"content": a})
            for c, a in zip(completions, answer, strict=True)]


def run_trl(out: Path, hf_dir: Path, s: dict, updates: int, evaluate: bool, seed: int) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rewards: list[float] = []

    def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
        values = exact_reward(prompts, completions, answer)
        rewards.append(sum(values) / len(values))  # one call per rollout batch: its mean reward
        return values

    ends: dict[int, float] = {}

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends[state.global_step] = time.perf_counter()

    batch = s["prompts"] * s["group"]
    config = GRPOConfig(
        output_dir=str(out / f"trl-seed{seed}"), report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        seed=seed, logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=batch, num_generations=s["group"], steps_per_generation=1,
        num_iterations=s["inner"], max_steps=updates * s["inner"],
        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"], top_k=0,
        beta=0.0, loss_type="dapo", scale_rewards="group" if s["scale_by_std"] else "none", epsilon=s["clip"],
        learning_rate=s["lr"], warmup_steps=s["warmup"] * s["inner"],
        lr_scheduler_type="constant_with_warmup" if s["end_fraction"] == 1.0 else "cosine",
        adam_beta1=s["b1"], adam_beta2=s["b2"], weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"],
        log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match], args=config,
                          train_dataset=Dataset.from_list(_chat_rows(s["train"])), processing_class=tokenizer,
                          callbacks=[Clock()])
    trainer.train()
    if len(rewards) != updates:
        raise RuntimeError(f"TRL rewarded {len(rewards)} rollout batches; expected {updates}")
    first, last = s["inner"], updates * s["inner"]
    result = {"rewards": rewards, "seconds_after_first": ends[last] - ends[first]}
    if evaluate:
        result["eval"] = _trl_eval(trainer.model, tokenizer, s)
    return result


def _trl_eval(model, tokenizer, s: dict) -> float:
    """Greedy answers to the eval prompts, scored by our `exact` (evaluate's answer_exact_match)."""
    import torch

    rows = _chat_rows(s["eval"])[:s["eval_examples"]]
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        output = model.generate(**encoded, max_new_tokens=s["eval_new_tokens"], do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = exact_reward(None, answers, [r["answer"] for r in rows])
    return sum(scores) / len(scores)


def run_cached(out: Path, side: str, seed: int, key: dict, run, resume: bool) -> dict:
    """One side's run at one seed, saved under `out`; with `resume`, the saved result of an earlier run with
    the same settings instead (a full comparison takes most of an hour on shared CPUs: a crash should not
    cost the runs already done). Opt-in: a result saved before a change to the library is not this code's."""
    path = out / "results" / f"{side}-seed{seed}.json"
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            print(f"{side} seed={seed}: reusing {path}", flush=True)
            return saved["result"]
    result = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "result": result}))
    return result


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """(mean, its standard error: the sample std with Bessel's correction over sqrt(K)); nan error for K=1."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def seed_summary(name: str, seed: int, result: dict, updates: int, last: int) -> tuple[float, float]:
    """(reward over the last `last` rollouts, updates per second) of one run, printed with its curve."""
    tail = result["rewards"][-last:]
    reward = sum(tail) / len(tail)
    rate = (updates - 1) / result["seconds_after_first"]
    tenth = max(len(result["rewards"]) // 10, 1)
    curve = [sum(result["rewards"][i:i + tenth]) / len(result["rewards"][i:i + tenth])
             for i in range(0, len(result["rewards"]), tenth)]
    evaluated = f" eval answer_exact_match {result['eval']:.3f}" if "eval" in result else ""
    print(f"{name} seed={seed}: reward over the last {len(tail)} rollouts {reward:.3f}; {rate:.3f} updates/s "
          f"(updates 2-{updates}: {result['seconds_after_first']:.1f} s){evaluated}; curve per {tenth}: "
          + " ".join(f"{c:.3f}" for c in curve), flush=True)
    return reward, rate


def summary(name: str, seeds: list[int], results: list[dict], updates: int, last: int) -> tuple[float, float, float]:
    """(mean over seeds of the last-`last` reward, its standard error, the median of updates per second)."""
    per_seed = [seed_summary(name, seed, result, updates, last) for seed, result in zip(seeds, results, strict=True)]
    rewards, rates = [r for r, _ in per_seed], [r for _, r in per_seed]
    mean, error = mean_and_error(rewards)
    rate = statistics.median(rates)
    evals = [r["eval"] for r in results if "eval" in r]
    evaluated = (f"; eval answer_exact_match {sum(evals) / len(evals):.3f} (" + " ".join(f"{e:.3f}" for e in evals)
                 + ")") if evals else ""
    print(f"{name}: reward over the last {last} rollouts {mean:.4f} (s.e. {error:.4f}, seeds "
          f"{','.join(map(str, seeds))}: " + " ".join(f"{r:.4f}" for r in rewards) + f"); {rate:.3f} updates/s "
          "(median: " + " ".join(f"{r:.3f}" for r in rates) + ")" + evaluated, flush=True)
    return mean, error, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sft", type=Path, default=None, help="an existing :sft workdir (else trained here)")
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--updates", type=int, default=40, help="N: rollout batches (updates) per side")
    parser.add_argument("--last", type=int, default=10, help="rollouts averaged for the reward after N updates")
    parser.add_argument("--seeds", type=int, default=3,
                        help="K: runs per side from the same start, seeds train.seed .. train.seed+K-1")
    parser.add_argument("--prompts", type=int, default=None, help="P (default: the config's)")
    parser.add_argument("--group", type=int, default=None, help="G (default: the config's)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--no-eval", action="store_true", help="skip both sides' eval answer_exact_match")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the per-seed results an earlier run with the same settings saved under --out")
    args = parser.parse_args()
    # One line each, naming the flag (the script's user errors are not tracebacks or usage dumps).
    if args.updates < 2:
        raise SystemExit(f"--updates={args.updates}: must be >= 2 (update 1 holds compilation; rates count from "
                         "update 2)")
    if not 1 <= args.last <= args.updates:
        raise SystemExit(f"--last={args.last}: must lie in 1..--updates ({args.updates})")
    if args.seeds < 1:
        raise SystemExit(f"--seeds={args.seeds}: must be >= 1 (runs per side)")
    s = settings(args.prompts, args.group, args.max_new_tokens)
    print(f"settings: {json.dumps(s)}", flush=True)
    sft, hf_dir = prepare_start(args.out, args.sft, args.sft_steps)
    seeds = [s["seed"] + k for k in range(args.seeds)]
    key = {"settings": s, "updates": args.updates, "evaluate": not args.no_eval, "sft": str(sft.resolve())}
    ours, trl = [], []
    # Interleaved, so a change in the machine's load over the hour falls on both sides alike.
    for seed in seeds:
        ours.append(run_cached(args.out, "ours", seed, key,
                               lambda seed=seed: run_ours(args.out, sft, s, args.updates, not args.no_eval, seed),
                               args.resume))
        trl.append(run_cached(args.out, "trl", seed, key,
                              lambda seed=seed: run_trl(args.out, hf_dir, s, args.updates, not args.no_eval, seed),
                              args.resume))
    reward_ours, error_ours, rate_ours = summary("ours", seeds, ours, args.updates, args.last)
    reward_trl, error_trl, rate_trl = summary("TRL", seeds, trl, args.updates, args.last)
    # Both at 0 (a start that never answers right): no ratio to state.
    ratio = reward_ours / reward_trl if reward_trl > 0 else (math.inf if reward_ours > 0 else math.nan)
    if reward_ours > 0 and reward_trl > 0:
        # First-order propagation of the two independent standard errors into the ratio's.
        spread = ratio * math.hypot(error_ours / reward_ours, error_trl / reward_trl)
        print(f"reward ours/TRL {ratio:.3f} (s.e. {spread:.3f} from the two sides' standard errors, "
              f"{len(seeds)} seeds each)", flush=True)
    print(f"reinforce_reward_vs_trl={ratio:.3f} steps_per_s_vs_trl={rate_ours / rate_trl:.3f}")


if __name__ == "__main__":
    main()
