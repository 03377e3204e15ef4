"""OpenAI request bodies -> one validated ``GenerationRequest``; every problem is a 400 naming its field.

Parsed by hand rather than by pydantic models: OpenAI refuses a wrong type
(``"max_tokens": "5"``) where pydantic's lax mode would coerce it, and each error
should name the parameter (``param``) the way OpenAI's do. Sampling values are
validated once, by constructing ``SamplingParams`` from exactly the dict that
goes into the queue message, so the router can never see a value the gateway
accepted and the engine refuses.

Supported: chat ``messages`` (string content or ``text`` parts), completion
``prompt`` (a string or token ids, one prompt), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``presence_penalty``, ``frequency_penalty``, ``n`` and completions' ``best_of`` (up to MAX_N), ``stream``,
``stream_options.include_usage``, ``logprobs`` / ``top_logprobs``, ``logit_bias``, ``user``,
``prompt_cache_key`` (session affinity; completions too, as an extension), ``response_format``
(``json_object``, ``json_schema``; completions too, as vLLM does: response_format.py); and
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``. Every other field of OpenAI's
API is listed in spec_fields.py: features pdserve does not have (tools,
non-text parts, echo, suffix, ...) are refused with a
400 naming them rather than ignored. Fields OpenAI does not define are ignored,
as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError
from services.gateway.request_record import CHAT, COMPLETION
from services.gateway import tools
from services.gateway.response_format import parse_response_format
from services.gateway.spec_fields import CHAT_FIELDS, COMPLETION_FIELDS, refuse_unsupported
from services.session_key import validate_session_key

_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_N = 8  # default cap on choices per request (n, best_of), gateway --max-n: one forked generation (choices.py)
_NUMBER_PARAMS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")


@dataclass
class GenerationRequest:
    kind: str  # chat | completion
    model: str | None  # None: the served model
    sampling: dict[str, Any]  # SamplingParams keyword arguments, validated
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-n alternatives per token; None: no logprobs
    messages: list[dict[str, str]] | None = None  # chat: [{"role", "content"}], content flattened to text
    prompt: str | list[int] | None = None  # completion
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    session_key: str = ""  # prompt_cache_key ("" for none; X-Session-ID fills it in at admission)
    structured_param: str = "response_format"  # what a structured-output error names (gRPC: sampling.structured)
    tools: list = field(default_factory=list)  # tools.Tool, for the prompt and the schema check
    tool_choice: Any = None  # tools.ToolChoice when the output may hold calls
    n: int = 1  # choices returned; more than one fans out into child requests (choices.py)
    best_of: int | None = None  # completions: candidates generated, the n likeliest returned
    hide_logprobs: bool = False  # best_of without logprobs: asked for to rank the candidates, not returned

    @property
    def candidates(self) -> int:
        return self.best_of or self.n

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.get("max_tokens")


def parse_json_body(raw: bytes) -> dict:
    """Strict UTF-8 JSON object: invalid UTF-8, NaN/Infinity, lone surrogates and non-objects are 400s."""
    try:
        body_text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if not body_text.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        body = json.loads(body_text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}") from None
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:  # "\ud800" parses, but is no text: it would fail later, deep in the tokenizer or Redis
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("the request body contains an invalid Unicode escape (a lone surrogate)") from None
    return body


def _no_constants(name: str):
    raise InvalidRequestError(f"{name} is not valid JSON")


def _kind_name(types: tuple) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def get_typed(body: dict, name: str, types: tuple, default=None):
    """``body[name]`` if it has one of ``types`` (bool is never an int or number); null means absent."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise InvalidRequestError(f"{name} must be {_kind_name(types)}, got {json.dumps(value)[:60]}", param=name)
    return value


def _common(body: dict, kind: str, max_n: int) -> tuple[dict, dict]:
    """The sampling dict and the stream/model/user settings every endpoint shares."""
    sampling: dict[str, Any] = {}
    for name in _NUMBER_PARAMS:
        value = get_typed(body, name, (float,))
        if value is not None:
            sampling[name] = value
    for name in ("top_k",):
        if (value := get_typed(body, name, (int,))) is not None:
            sampling[name] = value
    seed = get_typed(body, "seed", (int,))
    if seed is not None:
        if not _INT64[0] <= seed <= _INT64[1]:
            raise InvalidRequestError("seed must fit in a signed 64-bit integer", param="seed")
        sampling["seed"] = seed
    stop = get_typed(body, "stop", (str, list))
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if any(not isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop must be a string or an array of strings", param="stop")
        sampling["stop"] = stop
    if (ids := get_typed(body, "stop_token_ids", (list,))) is not None:
        sampling["stop_token_ids"] = ids
    for name in ("ignore_eos", "skip_special_tokens"):
        if (value := get_typed(body, name, (bool,))) is not None:
            sampling[name] = value

    max_tokens = get_typed(body, "max_tokens", (int,))
    if kind == CHAT:
        newer = get_typed(body, "max_completion_tokens", (int,))
        max_tokens = newer if newer is not None else max_tokens
        if newer is not None and newer < 1:
            raise InvalidRequestError(f"max_completion_tokens must be an integer >= 1, got {newer}",
                                      param="max_completion_tokens")
        sampling["max_tokens"] = max_tokens  # None: until the context is full (OpenAI's chat default)
    else:
        sampling["max_tokens"] = 16 if max_tokens is None else max_tokens  # OpenAI's completions default

    bias = get_typed(body, "logit_bias", (dict,))
    if bias:
        sampling["logit_bias"] = bias  # checked by SamplingParams (ids, range) and the gateway (vocabulary)
    n = check_n(get_typed(body, "n", (int,), 1), max_n)
    stream = get_typed(body, "stream", (bool,), False)
    options = get_typed(body, "stream_options", (dict,))
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        include_usage = get_typed(options, "include_usage", (bool,), False)
        if get_typed(options, "include_obfuscation", (bool,), False):
            raise InvalidRequestError("stream_options.include_obfuscation: pdserve never pads its chunks",
                                      param="stream_options.include_obfuscation")
    settings = {"n": n, "model": get_typed(body, "model", (str,)), "stream": stream, "include_usage": include_usage,
                "user": get_typed(body, "user", (str,)),
                "session_key": validate_session_key(body.get("prompt_cache_key"), "prompt_cache_key")}
    return sampling, settings


def _structured(body: dict, sampling: dict) -> None:
    """response_format into the sampling dict, as the queue message carries it (plain JSON)."""
    spec = parse_response_format(body.get("response_format"))
    if spec is not None:
        sampling["structured"] = {"kind": spec.kind, "spec": spec.spec}


def validate_sampling(sampling: dict) -> None:
    SamplingParams(**sampling)  # raises InvalidRequestError naming the parameter


def parse_chat(body: dict, max_n: int = MAX_N) -> GenerationRequest:
    refuse_unsupported(body, CHAT_FIELDS)
    if "messages" not in body:
        raise InvalidRequestError("messages is required", param="messages")
    raw = get_typed(body, "messages", (list,))
    messages = parse_messages(raw)

    sampling, settings = _common(body, CHAT, max_n)
    logprobs = get_typed(body, "logprobs", (bool,), False)
    top = get_typed(body, "top_logprobs", (int,))
    if top is not None and not logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
    if logprobs:
        sampling["logprobs"] = top or 0
    _structured(body, sampling)
    tool_list, choice = tools.parse_tools(body)
    constraint = tools.structured_output(tool_list, choice)
    if constraint is not None:
        if "structured" in sampling:
            raise InvalidRequestError("response_format cannot be combined with tool_choice required or a named "
                                      "function (both constrain the output)", param="response_format")
        sampling["structured"] = {"kind": constraint.kind, "spec": constraint.spec}
    validate_sampling(sampling)
    prompt_tools = tool_list if body.get("tool_choice") != "none" else []
    return GenerationRequest(CHAT, sampling=sampling, messages=messages, logprobs=sampling.get("logprobs"),
                             tools=prompt_tools, tool_choice=choice, **settings)


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Chat messages with their content flattened to text (text parts joined by newlines)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages must be a non-empty array", param="messages")
    return [_message(m, i) for i, m in enumerate(raw)]


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequestError(f"{param} must be an object with role and content", param=param)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:  # an object or array is no role (and unhashable)
        raise InvalidRequestError(f"{param}.role must be one of {sorted(_ROLES)}, got {json.dumps(role)[:40]}",
                                  param=f"{param}.role")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise InvalidRequestError(f"{param}.tool_calls must be an array of function calls with a name",
                                      param=f"{param}.tool_calls")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"{param}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else None
                raise InvalidRequestError(f"{where}: only text content parts are supported (got type "
                                          f"{json.dumps(kind)})", param=where)
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.text must be a string", param=f"{where}.text")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{param}.content must be a string or an array of text parts",
                                  param=f"{param}.content")
    if calls:  # the calls as the model writes them (tools.py), after any text
        content = "\n".join(part for part in (content, tools.render_calls(calls)) if part)
    return {"role": _ROLES[role], "content": content}


def parse_completion(body: dict, max_n: int = MAX_N) -> GenerationRequest:
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequestError("prompt is required", param="prompt")
    prompt = parse_prompt(body["prompt"])
    refuse_unsupported(body, COMPLETION_FIELDS)
    sampling, settings = _common(body, COMPLETION, max_n)
    logprobs = get_typed(body, "logprobs", (int,))
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    _structured(body, sampling)
    validate_sampling(sampling)
    best_of = _best_of(body, settings, max_n)
    hide = ask_logprobs_to_rank(sampling, best_of)
    return GenerationRequest(COMPLETION, sampling=sampling, prompt=prompt, logprobs=sampling.get("logprobs"),
                             best_of=best_of, hide_logprobs=hide, **settings)


def _best_of(body: dict, settings: dict, max_n: int) -> int | None:
    return check_best_of(get_typed(body, "best_of", (int,)), settings["n"], settings["stream"], max_n)


def ask_logprobs_to_rank(sampling: dict, best_of: int | None) -> bool:
    """best_of ranks the candidates by their tokens' logprobs: ask for them when the client did not (True:
    then they are hidden from the response)."""
    if best_of is None or sampling.get("logprobs") is not None:
        return False
    sampling["logprobs"] = 0
    return True


def check_n(n: int, max_n: int) -> int:
    """Choices per request: 1 to the gateway's --max-n (HTTP's 400, gRPC's INVALID_ARGUMENT, naming n)."""
    if not 1 <= n <= max_n:
        raise InvalidRequestError(f"n must be an integer in [1, {max_n}] (this server's --max-n), got {n}", param="n")
    return n


def check_best_of(best_of: int | None, n: int, stream: bool, max_n: int) -> int | None:
    """OpenAI's completions best_of: at least n, at most the cap, never streamed (the ranking needs whole
    outputs). None when it asks for no more candidates than choices."""
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise InvalidRequestError(f"best_of must be >= n ({n}), got {best_of}", param="best_of")
    if best_of > max_n:
        raise InvalidRequestError(f"best_of must be an integer in [1, {max_n}] (this server's --max-n), got {best_of}",
                                  param="best_of")
    if stream:
        raise InvalidRequestError("best_of > n cannot be streamed (the choices are ranked once all are done)",
                                  param="best_of")
    return best_of


def parse_prompt(value: Any) -> str | list[int]:
    """A string, token ids, or a one-element array of either (one prompt: n=1, no batches)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return value
    if isinstance(value, list):
        if not value:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(type(t) is int and t >= 0 for t in value):
            return value
        if all(isinstance(p, (str, list)) for p in value):
            raise InvalidRequestError("only one prompt per request is supported", param="prompt")
    raise InvalidRequestError("prompt must be a string or an array of token ids", param="prompt")
