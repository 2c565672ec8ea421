"""Request bodies of the OpenAI-compatible API as pydantic models, and the error body clients expect.

Only the shape is checked here (types, required fields); what the values mean for sampling is checked once, by
the same code that reads Triton requests (``protocol.sampling_kwargs``), so both front ends accept and refuse the
same things: the runtime's own keys, vLLM's extra keys (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ...), and keys this runtime does not implement only at their neutral values (``n=1``,
zero penalties, ...). Unknown fields are ignored, as the OpenAI API and vLLM do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Request fields that go to SamplingParams (through protocol.sampling_kwargs) under the same name.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
    "length_penalty", "include_stop_str_in_output", "spaces_between_special_tokens", "logit_bias",
    "truncate_prompt_tokens", "prompt_logprobs", "bad_words", "allowed_token_ids",
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    length_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    user: str | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling keys the client actually sent (unset fields keep the runtime's defaults)."""
        sent = self.model_fields_set
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if k in sent and getattr(self, k) is not None}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    include_reasoning: bool = True
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None


StreamOptions.model_rebuild()
_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
