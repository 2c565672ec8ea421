"""The request/response contract of the served model, kept free of Triton so it can be tested without a server.

Names and semantics follow Triton's vLLM backend, so existing clients (and Triton's ``generate`` endpoints) work
unchanged: ``text_input`` + optional ``stream`` / ``sampling_parameters`` / ``exclude_input_in_output`` in,
``text_output`` out. ``input_ids`` / ``output_ids`` serve clients that tokenize themselves. Streaming sends
deltas; a non-streaming request gets one response, by default with the prompt in front (as vLLM does).

The interface is a superset of the vLLM backend's, so clients written for it (Triton's own OpenAI frontend among
them) drive this model unchanged: the optional ``return_finish_reason`` / ``return_num_input_tokens`` /
``return_num_output_tokens`` / ``return_logprobs`` / ``return_cumulative_logprob`` inputs add the outputs of the
same names, and vLLM sampling keys this runtime does not implement are accepted at their neutral value
(``n=1``, ``min_tokens=0``, ...) and rejected with a clear error otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config spelling: TYPE_STRING, TYPE_INT64, TYPE_BOOL
    dims: tuple[int, ...]
    optional: bool = False


# text_input is optional in the config only because input_ids may replace it; the model enforces one of the two.
INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=True),
    TensorSpec("input_ids", "TYPE_INT64", (-1,), optional=True),
    TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_finish_reason", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_cumulative_logprob", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_logprobs", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", (1,), optional=True),
    # Images, as Triton's vLLM backend takes them: one element per image, base64 text or the encoded bytes; the
    # text prompt marks where each goes with ]<]image[>[ (m3export.serve.media).
    TensorSpec("image", "TYPE_STRING", (-1,), optional=True),
    # Videos (the vLLM backend has none): one element per video, a video file as base64 text or bytes (GIF / APNG /
    # WebP through Pillow, MP4 / WebM / ... through PyAV), or its frames as a JSON array of base64 images; the
    # prompt marks each with ]<]video[>[.
    TensorSpec("video", "TYPE_STRING", (-1,), optional=True),
)
# Optional outputs, each sent only when its return_<name> input is true (types as in the vLLM backend).
OPTIONAL_OUTPUTS = (
    TensorSpec("finish_reason", "TYPE_STRING", (-1,)),
    TensorSpec("cumulative_logprob", "TYPE_FP32", (-1,)),
    TensorSpec("logprobs", "TYPE_STRING", (-1,)),
    TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
    TensorSpec("num_output_tokens", "TYPE_UINT32", (-1,)),
)
OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("output_ids", "TYPE_INT64", (-1,)),
) + OPTIONAL_OUTPUTS

FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
INT_KEYS = ("top_k", "seed", "max_tokens", "logprobs")
BOOL_KEYS = ("ignore_eos", "skip_special_tokens")
LIST_KEYS = ("stop", "stop_token_ids")
SAMPLING_KEYS = FLOAT_KEYS + INT_KEYS + BOOL_KEYS + LIST_KEYS
NULLABLE_KEYS = ("seed", "logprobs")  # JSON null means "not set"
NULL_IS_DEFAULT = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")  # null: the default

# vLLM SamplingParams keys this runtime does not implement -> the values that mean "off" (accepted and ignored).
NEUTRAL_VALUES: dict[str, tuple] = {
    "n": (1,), "best_of": (None, 1), "min_tokens": (0,), "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "early_stopping": (False,), "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "detokenize": (True,), "bad_words": (None, []), "allowed_token_ids": (None,), "logit_bias": (None, {}),
    "guided_decoding": (None,), "structured_outputs": (None,), "lora_name": (None, ""),
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    for n in neutral:
        if n is None or isinstance(n, bool):
            if value is n:
                return True
        elif not isinstance(value, bool) and value == n:
            return True
    return False


def check_neutral(key: str, value: Any, where: str) -> None:
    """Accept a vLLM key this runtime does not implement only at its neutral value (request parameters may
    spell it as a string: ``"1"``, ``"false"``)."""
    neutral = NEUTRAL_VALUES[key]
    if isinstance(value, str):
        try:
            value = json.loads(value.lower() if value.lower() in ("true", "false", "null") else value)
        except ValueError:
            pass
    if not _is_neutral(value, neutral):
        shown = " or ".join(json.dumps(n) for n in neutral)
        raise RequestError(f"{where}: '{key}'={value!r} is not supported by this model; only {shown} (the "
                           "neutral value) is accepted")


class RequestError(ValueError):
    """The client sent something this model cannot run; the message goes back to that client only."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list[int]
    sampling: dict[str, Any]  # keyword arguments for SamplingParams
    stream: bool
    exclude_input: bool
    client_id: str = ""  # the client's request id, for log lines only
    returns: frozenset[str] = frozenset()  # optional outputs asked for (names in OPTIONAL_OUTPUTS)
    images: tuple[bytes, ...] = ()  # encoded images, prepared by the driver (m3export.serve.media)
    videos: tuple = ()  # encoded video files (bytes) or frame lists (encoded images), prepared likewise
    media: tuple = ()  # already prepared media items (runtime MediaItem), the prompt already expanded


@dataclass(frozen=True)
class Chunk:
    """One response: text and token ids (deltas when streaming), and whether it is the last one; with it what
    the optional outputs need: the finish reason (None until final), the prompt's length, the number of tokens
    in ``token_ids`` that were generated, their logprobs (one ``{token_id: logprob}`` per generated token, when
    the request computes them) and the cumulative logprob of every token generated so far."""

    text: str
    token_ids: list[int]
    final: bool
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


def _single(name: str, array: np.ndarray):
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one element, got shape {list(np.shape(array))}")
    return flat[0]


def _text(name: str, array: np.ndarray) -> str:
    value = _single(name, array)
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise RequestError(f"input '{name}' must be BYTES (a UTF-8 string), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _coerce(key: str, value: Any) -> Any:
    """vLLM clients send numbers as JSON numbers or as strings (request parameters are often strings)."""
    try:
        if value is None and key in NULLABLE_KEYS:
            return None
        if key in FLOAT_KEYS:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
        if key in INT_KEYS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value)
            return 0 if key == "top_k" and out == -1 else out  # vLLM spells "no top-k" as -1
        if key in BOOL_KEYS:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError
        if key == "stop":
            if isinstance(value, str):
                return (value,)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return tuple(value)
            raise ValueError
        if key == "stop_token_ids":
            if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return tuple(value)
            raise ValueError
    except (TypeError, ValueError):
        pass
    kind = ("a number" if key in FLOAT_KEYS else "an integer" if key in INT_KEYS else "a boolean"
            if key in BOOL_KEYS else "a string or a list of strings" if key == "stop" else "a list of integers")
    raise RequestError(f"'{key}' must be {kind}, got {value!r}")


def sampling_kwargs(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(k for k in raw if k not in SAMPLING_KEYS and k not in NEUTRAL_VALUES)
    if unknown:
        raise RequestError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; accepted: "
                           f"{', '.join(SAMPLING_KEYS)} (and vLLM's {', '.join(NEUTRAL_VALUES)} at their neutral "
                           "values)")
    for k, v in raw.items():
        if k in NEUTRAL_VALUES:
            check_neutral(k, v, where)
    try:
        return {k: _coerce(k, v) for k, v in raw.items()
                if k in SAMPLING_KEYS and not (v is None and k in NULL_IS_DEFAULT)}
    except RequestError as e:
        raise RequestError(f"{where}: {e}") from None


def _request_parameters(parameters: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Triton's generate endpoints turn JSON fields that are not inputs into request parameters, which is how
    ``{"text_input": ..., "max_tokens": 8}`` reaches us. Other fields land there too (``id``, ``priority``,
    Triton's own ``triton_*``), so only the sampling keys are read; ``sampling_parameters`` is checked strictly."""
    if not parameters:
        return {}
    raw = json.loads(parameters) if isinstance(parameters, str) else dict(parameters)
    return sampling_kwargs({k: v for k, v in raw.items() if k in SAMPLING_KEYS or k in NEUTRAL_VALUES},
                           "request parameters")


def parse_request(inputs: Mapping[str, np.ndarray], parameters: str | Mapping[str, Any] | None = None,
                  client_id: str = "") -> GenerateRequest:
    """Validate one request's input tensors (name -> numpy array) and parameters; raise RequestError."""
    has_text, has_ids = "text_input" in inputs, "input_ids" in inputs
    if has_text == has_ids:
        raise RequestError("send exactly one of 'text_input' (BYTES, shape [1]) and 'input_ids' "
                           f"(INT64, shape [-1]); got {'both' if has_text else 'neither'}")
    if has_text:
        prompt: str | list[int] = _text("text_input", inputs["text_input"])
    else:
        ids = np.asarray(inputs["input_ids"])
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input 'input_ids' must be INT64, got {ids.dtype}")
        prompt = [int(t) for t in ids.reshape(-1)]

    stream = bool(_single("stream", inputs["stream"])) if "stream" in inputs else False
    returns = frozenset(o.name for o in OPTIONAL_OUTPUTS
                        if f"return_{o.name}" in inputs and bool(_single(f"return_{o.name}",
                                                                          inputs[f"return_{o.name}"])))
    if "exclude_input_in_output" in inputs:
        exclude = bool(_single("exclude_input_in_output", inputs["exclude_input_in_output"]))
        if stream and not exclude:
            raise RequestError("exclude_input_in_output=false is not supported when streaming: "
                               "streamed responses carry only the new text")
    else:
        exclude = stream

    sampling = _request_parameters(parameters)
    if "sampling_parameters" in inputs:
        text = _text("sampling_parameters", inputs["sampling_parameters"])
        try:
            raw = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(f"sampling_parameters is not valid JSON ({e.msg} at character {e.pos}): "
                               f"{text[:80]!r}") from None
        if not isinstance(raw, dict):
            raise RequestError(f"sampling_parameters must be a JSON object, got {type(raw).__name__}")
        sampling.update(sampling_kwargs(raw, "sampling_parameters"))
    if returns & {"logprobs", "cumulative_logprob"} and sampling.get("logprobs") is None:
        sampling["logprobs"] = 0  # the sampled tokens' own logprobs, nothing more
    from .media import image_bytes, video_element

    images, videos = _elements(inputs, "image", image_bytes), _elements(inputs, "video", video_element)
    return GenerateRequest(prompt, sampling, stream, exclude, client_id, returns, images, videos=videos)


def _elements(inputs: dict[str, np.ndarray], name: str, parse) -> tuple:
    """The elements of an optional media input (``image``, ``video``), each parsed; () when absent."""
    if name not in inputs:
        return ()
    try:
        return tuple(parse(e) for e in np.asarray(inputs[name], dtype=object).reshape(-1))
    except ValueError as e:
        raise RequestError(f"input {name!r}: {e}") from None


def sampling_params(request: GenerateRequest):
    """SamplingParams for the request; its range checks become this request's error."""
    from ..runtime import SamplingParams

    try:
        return SamplingParams(**request.sampling)
    except ValueError as e:
        raise RequestError(str(e)) from None


def prompt_text(request: GenerateRequest, prompt_ids: list[int], tokenizer) -> str:
    """The prompt as text, for non-streaming responses that include it."""
    if isinstance(request.prompt, str):
        return request.prompt
    return tokenizer.decode(prompt_ids) if tokenizer is not None else ""


def chunk_for(request: GenerateRequest, out, prompt: str) -> Chunk | None:
    """What to send for one RequestOutput, or None when there is nothing to send yet.

    ``prompt`` is the prompt's text (see ``prompt_text``), used only when the prompt is included.
    """
    reason = out.finish_reason if out.finished else None
    # The running sum and the deltas the output carries: reading its cumulative fields at every step would copy
    # the whole generation each time (``runtime.outputs.Deferred``).
    info = {"finish_reason": reason, "num_input_tokens": len(out.prompt_token_ids),
            "cumulative_logprob": out.cumulative_logprob}
    if request.stream:
        if not (out.new_token_ids or out.new_text or out.finished):
            return None
        return Chunk(out.new_text, list(out.new_token_ids), out.finished, num_output_tokens=len(out.new_token_ids),
                     logprobs=out.new_logprobs, **info)
    if not out.finished:
        return None
    info.update(num_output_tokens=len(out.token_ids), logprobs=out.logprobs)
    if request.exclude_input:
        return Chunk(out.text, list(out.token_ids), True, **info)
    return Chunk(prompt + out.text, list(out.prompt_token_ids) + list(out.token_ids), True, **info)
