"""The request bodies the server accepts (OpenAI's chat and completions shapes, validated by pydantic).

Unknown fields are refused (`extra="forbid"`): a client asking for something this server does not do
gets an error naming the field, not an answer that silently ignored it. Defaults differ from OpenAI's in
one place: `temperature` defaults to 0 (greedy, as `python -m valen_jax.generate`).

Log-probabilities (`serving.logprobs`): chat's `logprobs: true` with `top_logprobs: k`, completions'
`logprobs: k` with `echo` (the prompt's tokens scored too: lm-eval's loglikelihood requests send
`echo: true, max_tokens: 1, logprobs: 1`, OpenAI's legacy shape). OpenAI caps k at 20 (chat) and 5
(completions); both routes accept up to 20."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from valen_jax.serving.errors import APIError

TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's chat limit)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class Message(BaseModel):
    # Assistant turns sent back carry fields (`refusal`, `annotations`, ...) clients echo; tolerated here
    # since a message is conversation history, not an option of this request.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Function(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class Sampled(_Strict):
    model: str
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # an extension (OpenAI has none): 0 is off
    max_tokens: int | None = Field(None, ge=0)  # 0: only with a completion's echo (the prompt scored)
    seed: int = Field(0, ge=0, lt=2 ** 32)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto"] | None = None  # "auto" is what the template renders; nothing else is honoured
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)

    def top(self) -> int | None:
        """The alternatives per token when log-probabilities are asked for, else None."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: given without logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampled):
    # One prompt (text or token ids) or several (each its `n` choices, in order: OpenAI's batch shape, which
    # lm-eval sends with a tokenizer: a list of token-id lists).
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)

    def top(self) -> int | None:
        return self.logprobs


class ScoreRequest(_Strict):
    """`POST /v1/valen/score`: seed-000 Valen records (as lines of a Valen JSONL), scored as `predict` does."""

    model: str
    records: list[dict] = Field(min_length=1, max_length=256)
    mode: Literal["question", "shared_state"] | None = None  # default: the checkpoint's data.valen_mode
