"""One served workdir: the restored model, its tokenizer and chat template, and its slot engine.

Turns a validated request into prompt ids and engine `Request`s, and generated ids back into text,
tool calls (`serving.tool_calls`, over `evaluation.chat.parse_tool_calls`, the parser `generate` writes
answers with) and a finish reason. Every refusal is an `APIError` naming the request's field."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import threading
from pathlib import Path

import numpy as np

from data_pipeline.chat_templates import template_family
from data_pipeline.format_registry import FORMATS
from data_pipeline.formats.errors import FormatError
from data_pipeline.primitives import AtomicCalls
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.decoding.engine import bucket
from valen_jax.decoding.sampling import Sampling
from valen_jax.decoding.speculative import CachedDrafter
from valen_jax.errors import EvaluationError, UsageError
from valen_jax.evaluation.answers import vflash_fields
from valen_jax.evaluation.valen import predict_valen_data
from valen_jax.serving import collector, images, logprobs
from valen_jax.serving.errors import APIError
from valen_jax.serving.logprobs import Scores, TokenText
from valen_jax.serving.protocol import ChatRequest, CompletionRequest, Sampled, ScoreRequest
from valen_jax.serving.slots import QueueFull, Request, SlotEngine
from valen_jax.serving.speculative_slots import SpeculativeSlotEngine
from valen_jax.serving.tool_calls import split_message

log = logging.getLogger(__name__)


def _arguments_as_objects(message: dict) -> None:
    """An assistant turn sent back carries its calls as OpenAI returns them, `function.arguments` a JSON
    string; hub templates render arguments with `| tojson` (Qwen2.5, Llama 3.1), which would quote that
    string, so a string holding a JSON object is given to the template as the object (the text the model
    wrote, and was trained on). Any other string is left as the client sent it."""
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                function["arguments"] = parsed


class Service:
    def __init__(self, restored, *, slots: int, max_queue: int, api_key: str | None = None, steps_per_sync: int = 4,
                 warm: bool = True, drafter=None):
        """restored: the workdir's `run.ModelRun`; drafter: a `run.DrafterRun` trained against it (speculative
        decoding of announced blocks, `serving.speculative_slots`), or None."""
        self.restored, self.tokenizer, self.api_key = restored, restored.tokenizer, api_key
        self.name = Path(restored.workdir).name
        self.context = int(restored.spec.seq_len)
        self.eot = end_of_turn_id(self.tokenizer)
        self.token_text = TokenText(self.tokenizer)  # tokens as log-probability entries show them
        self.family = template_family(self.tokenizer.chat_template)
        self.default_max = int(restored.config.eval.max_new_tokens)
        # A VFlash workdir's answers carry their parsed primitives (`extension`), as `generate` writes them.
        self.vflash = FORMATS[restored.config.data.eval_format].family == "vflash"
        # Every prompt bucket of a prompt within the context must fit the cache (kv_cache.from_prefill).
        engine = dict(vocab=len(self.tokenizer), stop_ids=(self.eot,), slots=slots, cache_length=bucket(self.context),
                      max_queue=max_queue, steps_per_sync=steps_per_sync)
        self.drafter = drafter
        if drafter is None:
            self.engine = SlotEngine(restored.params, restored.graphdef, **engine)
        else:
            self.engine = SpeculativeSlotEngine(
                restored.params, restored.graphdef, calls=AtomicCalls(self.tokenizer),
                drafter=CachedDrafter(drafter.graphdef, drafter.params, len(self.tokenizer)), **engine)
        self.pauses = collector.pauses()
        if warm:
            self.engine.warm()
            log.info("serve: compiled every prefill bucket and greedy decode shape in %.1f s (warm-up; sampled "
                     "kinds compile in the background); %s",
                     self.engine.warm_seconds, collector.freeze())
            # The background compile's objects too, once it has ended.
            threading.Thread(target=self._freeze_after_warm, name="valen-freeze", daemon=True).start()
        self._scoring = threading.Lock()  # one scoring request at a time (each converts and compiles its rows)

    def _freeze_after_warm(self) -> None:
        self.engine.wait_warm()
        if self.engine.background_warm_seconds is not None:  # not stopped before the end
            log.info("serve: after the background compile, %s", collector.freeze())

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "valen-jax",
                "valen": {"workdir": str(self.restored.workdir), "step": self.restored.step,
                          "tokenizer": str(getattr(self.tokenizer, "name_or_path", "")), "drafter": self.drafter_card(),
                          "context": self.context, "slots": self.engine.slots}}

    def drafter_card(self) -> dict | None:
        if self.drafter is None:
            return None
        return {"workdir": str(self.drafter.workdir), "step": self.drafter.step,
                "block_size": self.drafter.cfg.block_size}

    def check_model(self, body: Sampled | ScoreRequest) -> None:
        if body.model != self.name:
            raise APIError(404, f"model: {body.model!r} is not served here (this server serves {self.name!r})",
                           "model", "model_not_found")

    # -- prompts --
    @staticmethod
    def has_images(body: ChatRequest) -> bool:
        return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in body.messages)

    def chat_prompt(self, body: ChatRequest) -> dict:
        """{"ids"} of a text conversation (the chat template with the generation prompt, as `generate`), or
        {"ids", "positions", "vision"} of one with image parts (`images.vision_prompt`, `generate`'s path:
        blocking, the route runs it in a worker thread)."""
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        for message in messages:
            _arguments_as_objects(message)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        if self.has_images(body):
            if body.logprobs:
                raise APIError(400, "logprobs: not computed for a conversation with image parts (the scoring "
                               "forward reads text positions)", "logprobs")
            if self.restored.model_cfg.vision is None:
                i, j = next((i, j) for i, m in enumerate(messages) if isinstance(m.get("content"), list)
                            for j, part in enumerate(m["content"]) if part["type"] == "image_url")
                where = f"messages[{i}].content[{j}]"
                raise APIError(400, f"{where}: an image part, but {self.name!r} is a text-only model",
                               where, "image_not_supported")
            return images.vision_prompt(self.restored, messages, tools)
        for turn in messages:
            if isinstance(turn.get("content"), list):
                turn["content"] = "".join(part["text"] for part in turn["content"])
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        except Exception as error:  # jinja: a message the template cannot render
            raise APIError(400, f"messages: the chat template cannot render them: {error}", "messages") from None
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return {"ids": np.asarray(ids, np.int32)}

    def completion_prompts(self, body: CompletionRequest) -> list[dict]:
        """{"ids", "text"} of each prompt of the request (`text`: what `echo` writes before the answer)."""
        one = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
        prompts = [body.prompt] if one else body.prompt
        if not prompts:
            raise APIError(400, "prompt: empty", "prompt")
        out = []
        for k, prompt in enumerate(prompts):
            where = "prompt" if one else f"prompt[{k}]"
            if isinstance(prompt, str):
                ids, text = self.tokenizer.encode(prompt, add_special_tokens=False), prompt
            else:
                ids = prompt
                if any(not 0 <= t < len(self.tokenizer) for t in ids):
                    raise APIError(400, f"{where}: token ids must be in [0, {len(self.tokenizer)})", where)
                text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if not ids:
                raise APIError(400, f"{where}: empty", where)
            out.append({"ids": np.asarray(ids, np.int32), "text": text})
        return out

    def scores(self, ids, first: int = 1) -> Scores:
        """The model's log-probabilities of `ids[first:]`, each given those before it (`serving.logprobs`;
        blocking)."""
        return logprobs.score(self.restored, len(self.tokenizer), ids, first)

    # -- generation --
    def budget(self, body: Sampled, ids: np.ndarray) -> int:
        """The request's new-token budget for a prompt of `ids`; 0: the prompt is only echoed (and scored)."""
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        field = "messages" if isinstance(body, ChatRequest) else "prompt"
        if asked == 0 and not getattr(body, "echo", False):
            raise APIError(400, "max_tokens: 0 generates nothing; it is for a completion with echo (the prompt "
                           "scored)", "max_tokens")
        if len(ids) >= self.context:
            raise APIError(400, f"{field}: {len(ids)} prompt tokens; the model's context is {self.context}",
                           field, "context_length_exceeded")
        if self.drafter is not None and len(ids) < 2:
            # The speculative prefill covers every prompt token but the last (`speculative_slots`).
            raise APIError(400, f"{field}: 1 prompt token; with a drafter the server needs at least 2", field,
                           "prompt_too_short")
        if asked is None:
            return min(self.default_max, self.context - len(ids))
        if len(ids) + asked > self.context:
            raise APIError(400, f"max_tokens: {len(ids)} prompt tokens + {asked} exceed the model's context of "
                           f"{self.context}", "max_tokens", "context_length_exceeded")
        return int(asked)

    def sampling(self, body: Sampled) -> Sampling:
        try:
            return Sampling(temperature=float(body.temperature), top_k=int(body.top_k), top_p=float(body.top_p))
        except ValueError as error:
            param = "top_k" if body.top_k else "top_p"
            raise APIError(400, f"{param}: {error}", param) from None

    def submit(self, body: Sampled, prompts: list[dict]) -> tuple[list[Request], asyncio.Queue]:
        """Each prompt's `n` choices in the engine (choice index: prompt * n + choice), all or none; their events
        (choice index, token | None) on one queue. A budget of 0 (an echo) submits nothing: its choices end
        at once."""
        budgets, sampling = [self.budget(body, prompt["ids"]) for prompt in prompts], self.sampling(body)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        requests = []
        for prompt, budget in zip(prompts, budgets, strict=True):
            for choice in range(body.n):
                index = len(requests)

                def emit(token, index=index):
                    loop.call_soon_threadsafe(events.put_nowait, (index, token))
                requests.append(Request(prompt["ids"], budget, sampling, int(body.seed), choice, emit,
                                        positions=prompt.get("positions"), vision=prompt.get("vision")))
        echoed = [r for r in requests if r.max_new == 0]
        try:
            self.engine.submit(*(r for r in requests if r.max_new > 0))  # all choices or none
        except QueueFull as error:
            status = 503 if self.engine._stopping else 429
            raise APIError(status, str(error), None, "overloaded", "server_error", {"Retry-After": "1"}) from None
        for request in echoed:
            request.finish_reason = "length"
            request.emit(None)
        return requests, events

    # -- Valen scoring --
    def score(self, body: ScoreRequest) -> dict:
        """The answer lines `python -m valen_jax.predict` writes for these records (`evaluation.valen.
        predict_valen_data`, predict's own conversion and scoring), in request order. Blocking: the route
        runs it in a worker thread, beside the slot engine."""
        if not self.restored.model_cfg.score_head:
            raise APIError(400, f"model: {self.name!r} has no Valen score head (trained with loss.weights.branches"
                           "=0); Valen records are scored by a configs/valen.py run", "model", "no_score_head")
        with self._scoring, tempfile.TemporaryDirectory(prefix="valen-score-") as folder:
            data = Path(folder) / "records.jsonl"
            data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in body.records), encoding="utf-8")
            try:
                mode, lines = predict_valen_data(self.restored, data, body.mode, shards_root=folder)
            except FormatError as error:  # seed 000's validation, its line k is records[k - 1]
                first = error.problems[0]
                where = f"records[{first.line - 1}]" + (f".{first.field}" if first.field != "record" else "")
                raise APIError(400, f"{where}: {first.message}", where) from None
            except (EvaluationError, UsageError) as error:
                raise APIError(400, f"records: {error}", "records") from None
        return {"object": "valen.scores", "model": self.name, "mode": mode, "data": lines}

    def extension(self, text: str) -> dict | None:
        """The `valen` field of a finished choice: for a VFlash model, its primitives with dequantised
        coordinates, its atomic_decoding calls and the parse error (`evaluation.answers.vflash_fields`,
        the fields `python -m valen_jax.generate` writes; no dense_scale is known to a request, so dense
        tokens get no metres); None for other models."""
        return vflash_fields(text, None) if self.vflash else None

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The assistant message of a finished choice and its finish reason, in OpenAI's shape: its tool calls
        (arguments as JSON strings) and the text outside their markup (`serving.tool_calls`, the split the
        stream makes), "tool_calls" when it makes any."""
        content, calls = split_message(text, self.family)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
