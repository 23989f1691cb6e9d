"""Serving against offline generation: `python -m valen_jax.serve`'s engine behind uvicorn, on the same
prompts as `decoding.engine.generate_ids` (what `generate` runs), measured in the same run.

    .venv/bin/python benchmarks/serve.py                       # trains configs/chat.py:tiny for 4 steps first
    .venv/bin/python benchmarks/serve.py --workdir=runs/chat-smoke [--requests=64] [--new-tokens=32]
    .venv/bin/python benchmarks/serve.py --drafter=auto        # serve --drafter: trains a tiny vflash target
    .venv/bin/python benchmarks/serve.py --workdir=TARGET --drafter=DRAFTER

With `--drafter` the server runs `--drafter=DRAFTER` (speculative decoding of announced blocks,
`serving.speculative_slots`) and offline is `SpeculativeDecoder.generate_batch` with the same drafter
(what `generate` and evaluation run); every prompt ends with a compact `atomic_decoding` call of a
16-token block, so each answer starts with a drafted block. `--drafter=auto` trains the tiny vflash
target and a drafter against it for 4 steps each (as tests/test_serve_speculative.py): its acceptance is
low, so the figure is the serving overhead of the speculative engine against offline speculative
decoding, not the speed-up of speculation. The run also prints the verify passes and accepted tokens
`usage` reported, summed.

64 raw-text prompts of 4–96 tokens, each asking `--new-tokens` (the model's end-of-turn token may end an
answer earlier: both sides count the tokens actually produced). Offline: `generate_ids` over all of
them in batches of `--slots` rows, greedy. Served: a server with `--slots` decode slots in this process
(`python -m valen_jax.serve` on 127.0.0.1, its own process), the requests streamed (`/v1/completions`, `stream: true`)
by httpx clients at concurrency 1, 8 and 32, each client keeping its connection. Every program is
compiled before timing (one warm-up offline pass; the server compiles at start-up, and the timing starts
after its background compile, `background_warm_up_s`). Each concurrency runs `--passes` timed passes
(after an untimed one that warms its connections), each paired with an offline pass run just before it
while the server idles: the ratio is the median of the pairs' ratios (before, offline's median pass was
taken once before the server started, and the ratio swung 0.70-1.38 between runs on this host: its
speed drifts over the minutes between the two sides). tokens/s is the median pass's, and the latency
percentiles pool every timed pass's requests (5 x 64 by default): one pass of 64 short answers lasts a
fraction of a second here.

Figures per concurrency: output tokens/s (all tokens / wall time), time to first token (request sent →
first streamed chunk with text or a finish_reason: an answer that is only the end-of-turn token has no
text) p50/p95, per-token latency (a request's streamed span / its tokens after the first)
p50/p95. `prefill` is the median of 5 single requests of the longest prompt asking one token (TTFT
alone, HTTP included). Under each concurrency, the engine's side of its first tokens (`GET
/v1/valen/metrics`: queue, behind other prefills, own prefill, decode call), and the fractions of the
timed served passes the engine thread spent prefilling and decoding (its `busy_s`); then `ttft_p95_c8 / prefill`. Last line: `serve_throughput_vs_offline=X ttft_p95_ms=Y`: the paired ratio of
served tokens/s at concurrency 8 over offline tokens/s, and the TTFT p95 at concurrency 8 (goals: X >= 0.8, Y <= 2 x prefill).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import queue
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the weather in wellington is windy and cold while oslo has snow and nairobi is cloudy".split()


def prompts(count: int, words: int = 96) -> list[str]:
    """`count` prompts of 4 to `words` - 1 words."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(n))) for n in rng.integers(4, words, size=count)]


BLOCK_CALL = ('<tool_call>{"name":"atomic_decoding","arguments":{"block_size":16}}</tool_call>')


def train_smoke(workdir: Path, config: str = "configs/chat.py:tiny", *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "valen_jax.train", f"--config={config}", f"--workdir={workdir}",
                    "--config.train.steps=4", "--config.train.checkpoint_every=4", "--config.eval.at_end=False",
                    *extra], cwd=ROOT, check=True, capture_output=True)


def train_speculative(home: Path) -> tuple[Path, Path]:
    """(the tiny vflash target, a drafter trained 4 steps against it)."""
    target, drafter = home / "target", home / "drafter"
    train_smoke(target, "configs/vflash.py:tiny")
    train_smoke(drafter, "configs/vflash.py:tiny,drafter", f"--config.model.target_from={target}",
                "--config.train.learning_rate=0.01")
    return target, drafter


def stream_one(client: httpx.Client, url: str, model: str, prompt: str, new_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, stamps, tokens, first, usage = time.perf_counter(), [], 0, None, {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise SystemExit(f"the server answered {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            if first is None and chunk["choices"] and (chunk["choices"][0]["text"]
                                                       or chunk["choices"][0]["finish_reason"]):
                first = time.perf_counter()  # the first token's event, even an end-of-turn token with no text
            if chunk.get("usage"):
                tokens, usage = chunk["usage"]["completion_tokens"], chunk["usage"]
    return {"ttft": first - sent,
            "per_token": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and stamps else float("nan"), "tokens": tokens,
            "speculation": usage.get("valen")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--steps-per-sync", type=int, default=4)
    parser.add_argument("--passes", type=int, default=5, help="timed passes offline and per concurrency")
    parser.add_argument("--drafter", default=None, help="a drafter workdir trained against --workdir (serve "
                        "--drafter against offline speculative decoding), or `auto` to train both tiny ones")
    args = parser.parse_args()
    from data_pipeline.primitives import AtomicCalls
    from valen_jax.decoding.engine import bucket, generate_ids
    from valen_jax.decoding.speculative import CachedDrafter, SpeculativeDecoder
    from valen_jax.serve import load_service

    tmp = tempfile.TemporaryDirectory()
    workdir, drafter = Path(args.workdir) if args.workdir else None, args.drafter
    if drafter == "auto":
        workdir, drafter = train_speculative(Path(tmp.name))
    elif drafter is not None and workdir is None:
        raise SystemExit("--drafter=DIR needs --workdir=TARGET (or --drafter=auto)")
    elif workdir is None:
        workdir = Path(tmp.name) / "chat-smoke"
        train_smoke(workdir)
    service = load_service(workdir, slots=args.slots, max_queue=max(args.requests, 64), steps_per_sync=args.steps_per_sync,
                           warm=False, drafter=drafter)  # offline only: the server warms its own
    # The vflash target's context (192 tokens for the tiny one) holds a shorter prompt beside the call.
    texts = [t + BLOCK_CALL for t in prompts(args.requests, 40)] if drafter else prompts(args.requests)
    ids = [np.asarray(service.tokenizer.encode(t, add_special_tokens=False), np.int32) for t in texts]
    if max(map(len, ids)) + args.new_tokens > service.context:
        raise SystemExit(f"a prompt of {max(map(len, ids))} tokens + {args.new_tokens} new exceeds the model's "
                         f"context of {service.context}")
    run = service.restored
    service.engine.stop(drain=False)  # this process only decodes offline: the server is its own process

    rows = [{"ids": i, "positions": np.arange(len(i), dtype=np.int32)} for i in ids]
    if drafter is not None:  # built once, outside the timed passes
        decoder = SpeculativeDecoder(run.graphdef, run.params, calls=AtomicCalls(service.tokenizer),
                                     vocab=len(service.tokenizer), stop_ids=(service.eot,))
        draft = CachedDrafter(service.drafter.graphdef, service.drafter.params, len(service.tokenizer))

    def offline() -> int:
        if drafter is None:
            out = generate_ids(run.params, run.graphdef, rows, max_new_tokens=args.new_tokens, stop_ids=(service.eot,),
                               vocab=len(service.tokenizer), local_batch=args.slots)
        else:
            out = [row for start in range(0, len(rows), args.slots) for row in
                   decoder.generate_batch(rows[start:start + args.slots], draft, max_new_tokens=args.new_tokens)]
        return sum(len(row) for row in out)

    def offline_rate_now() -> float:
        start = time.perf_counter()
        tokens = offline()
        return tokens / (time.perf_counter() - start)

    offline_tokens = offline()  # compiles
    first_rates = [offline_rate_now() for _ in range(args.passes)]
    print(f"offline generate_ids (batches of {args.slots}): {offline_tokens} tokens, {np.median(first_rates):.1f} tokens/s "
          f"(median of {args.passes} passes; each served pass below is paired with an offline pass run just before it)")

    # The server in its own process, as deployed: the clients' threads must not share its interpreter lock.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "valen_jax.serve", f"--workdir={workdir}", f"--port={port}",
                               f"--max-batch={args.slots}", f"--max-queue={max(args.requests, 64)}",
                               f"--steps-per-sync={args.steps_per_sync}",
                               *([f"--drafter={drafter}"] if drafter else [])], cwd=ROOT)
    try:
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
                break
            except httpx.TransportError:
                if server.poll() is not None:
                    raise SystemExit(f"the server exited with {server.returncode} before it listened") from None
                time.sleep(0.2)
        url, model = f"http://127.0.0.1:{port}", service.name
        # The server answers once its greedy programs are compiled and compiles the sampled kinds' in the
        # background (`SlotEngine.warm`); measure after that, as a server that has been up a while.
        while httpx.get(url + "/v1/valen/metrics", timeout=5).json()["background_warm_up_s"] is None:
            time.sleep(0.2)
        # Each client keeps its connection (as the openai client's pool does): a new httpx.Client per request
        # costs 30-90 ms of the benchmark's own CPU (its SSL context), which this measured instead of the server.
        clients = queue.SimpleQueue()
        for _ in range(32):
            clients.put(httpx.Client())

        def request(prompt: str, new_tokens: int) -> dict:
            client = clients.get()
            try:
                return stream_one(client, url, model, prompt, new_tokens)
            finally:
                clients.put(client)

        for size in sorted({bucket(len(i)) for i in ids}):  # compile every prompt bucket and the decode step
            request(texts[next(k for k, i in enumerate(ids) if bucket(len(i)) == size)], 2)
        longest = texts[int(np.argmax([len(i) for i in ids]))]
        httpx.get(url + "/v1/valen/metrics", params={"reset": "true"}, timeout=5).raise_for_status()
        prefill = float(np.median([request(longest, 1)["ttft"] for _ in range(5)]))
        alone = httpx.get(url + "/v1/valen/metrics", timeout=5).json()["prefill_ms"]
        print(f"prefill of the longest prompt ({max(map(len, ids))} tokens, one token, HTTP included): "
              f"{prefill * 1e3:.1f} ms (the engine's prefill call p50 {alone['p50']:.1f} ms)")
        results = {}
        for concurrency in (1, 8, 32):
            # An untimed pass first (it warms this concurrency's connections), then `--passes` timed ones.
            passes, ratios, busy = [], [], {"prefill": 0.0, "decode": 0.0}
            for k in range(args.passes + 1):
                if k == 1:  # the engine's figures below cover the timed passes
                    httpx.get(url + "/v1/valen/metrics", params={"reset": "true"}, timeout=5).raise_for_status()
                # Offline just before (the server idle): a drift of the host's speed between the two sides of a
                # ratio measured minutes apart swung it by +-0.3 between runs; a pair shares the host's state.
                if k:
                    offline_rate = offline_rate_now()
                    before = httpx.get(url + "/v1/valen/metrics", timeout=5).json()["busy_s"]
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                    got = list(pool.map(lambda t: request(t, args.new_tokens), texts))
                passes.append((time.perf_counter() - start, got))
                if k:
                    ratios.append(sum(g["tokens"] for g in got) / passes[-1][0] / offline_rate)
                    after = httpx.get(url + "/v1/valen/metrics", timeout=5).json()["busy_s"]
                    for work in busy:  # the engine thread's seconds in this pass (the offline pass not counted)
                        busy[work] += after[work] - before[work]
            timed = passes[1:]
            served_s = sum(w for w, _ in timed)
            tokens = sum(g["tokens"] for g in timed[0][1])  # greedy: every pass produces the same tokens
            rate = float(np.median([sum(g["tokens"] for g in pass_) / w for w, pass_ in timed]))
            ratio = float(np.median(ratios))
            got = [g for _, pass_ in timed for g in pass_]
            ttft = np.array([g["ttft"] for g in got]) * 1e3
            per = np.array([g["per_token"] for g in got if g["tokens"] > 1]) * 1e3
            results[concurrency] = (ratio, np.percentile(ttft, 95))
            if drafter:  # the usage's verify statistics (`serving.speculative_slots`), summed over one pass
                spent = {k: sum(g["speculation"][k] for g in timed[0][1]) for k in got[0]["speculation"]}
                # A plain step in a span whose drafting stopped is a pass of one token (`BlockStats.tau`).
                undrafted = spent.get("undrafted_tokens", 0)
                print(f"    speculation: {spent} (tau = (block tokens + undrafted) / (verify passes + undrafted) = "
                      f"{(spent['block_tokens'] + undrafted) / max(spent['verify_passes'] + undrafted, 1):.2f})")
            # The engine's side of every pass's first tokens (`GET /v1/valen/metrics`): queue, prefill, decode calls.
            engine = httpx.get(url + "/v1/valen/metrics", timeout=5).json()
            where = ", ".join(f"{k[:-3]} p50 {engine[k]['p50']:.1f} p95 {engine[k]['p95']:.1f}" for k in
                              ("queue_ms", "behind_prefills_ms", "prefill_ms", "first_token_ms", "decode_call_ms"))
            print(f"concurrency {concurrency:2d}: {tokens} tokens a pass, {rate:.1f} tokens/s "
                  f"({ratio:.2f}x offline, the median of the paired passes' ratios), TTFT p50 {np.percentile(ttft, 50):.1f} ms "
                  f"p95 {np.percentile(ttft, 95):.1f} ms, per token p50 {np.percentile(per, 50):.1f} ms "
                  f"p95 {np.percentile(per, 95):.1f} ms\n    engine (ms): {where}\n    engine busy: prefill "
                  f"{busy['prefill'] / served_s:.2f}, decode {busy['decode'] / served_s:.2f} of the timed "
                  f"passes' {served_s:.2f} s; garbage collections {engine['garbage_collection']}")
        while not clients.empty():
            clients.get().close()
    finally:  # a failed run must not leave its server behind (it holds this run's stdout)
        server.terminate()  # SIGTERM: stops accepting, finishes in-flight requests, exits
        server.wait()
    print(f"ttft_p95_c8 / prefill = {results[8][1] / (prefill * 1e3):.2f}")
    print(f"serve_throughput_vs_offline={results[8][0]:.2f} ttft_p95_ms={results[8][1]:.1f}")


if __name__ == "__main__":
    main()
