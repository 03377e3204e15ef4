"""A request's prompt as token ids: the chat template for messages, the tokenizer for text, checks for ids.

Tokenizing is CPU work on the event loop; long prompts (which take
milliseconds) go to a thread so one big request does not stall every stream.
"""

from __future__ import annotations

import asyncio

from services.errors import InvalidRequestError
from services.gateway import tools
from services.gateway.served_model import ServedModel

_INLINE_CHARS = 4096  # below this, tokenizing inline is cheaper than a thread hop


def _with_tools(model: ServedModel, messages: list[dict], tool_list: list) -> tuple[list[dict], list | None]:
    """The template's own tool rendering where it has one; else the tool list as a system message."""
    if not tool_list:
        return messages, None
    if model.tokenizer.renders_tools:
        return messages, [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.parameters}} for t in tool_list]
    text = tools.system_prompt(tool_list)
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def _encode(model: ServedModel, messages: list[dict] | None, prompt: str | list[int] | None,
            tool_list: list | None = None) -> list[int]:
    if messages is None and isinstance(prompt, list):
        bad = [t for t in prompt if t >= model.vocab_size] if model.vocab_size else []
        if bad:
            raise InvalidRequestError(f"prompt has token id {bad[0]}, outside the vocabulary of "
                                      f"{model.vocab_size} tokens", param="prompt")
        return list(prompt)
    if model.tokenizer is None:
        raise InvalidRequestError(f"model {model.name!r} has no tokenizer; send the prompt as token ids to "
                                  "/v1/completions", param="messages" if messages is not None else "prompt")
    if messages is not None:
        try:
            messages, template_tools = _with_tools(model, messages, tool_list or [])
            ids = model.tokenizer.apply_chat_template(messages, template_tools)
        except InvalidRequestError:
            raise
        except Exception as exc:  # the template itself refused (e.g. roles must alternate)
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
    else:
        ids = model.tokenizer.encode(prompt)
    if not ids:
        raise InvalidRequestError("the prompt is empty after tokenization",
                                  param="messages" if messages is not None else "prompt")
    return ids


def _size(messages: list[dict] | None, prompt: str | list[int] | None) -> int:
    if messages is not None:
        return sum(len(m["content"]) for m in messages)
    return len(prompt) if isinstance(prompt, str) else 0


async def encode(model: ServedModel, messages: list[dict] | None = None,
                 prompt: str | list[int] | None = None, tool_list: list | None = None) -> list[int]:
    if _size(messages, prompt) < _INLINE_CHARS and not tool_list:
        return _encode(model, messages, prompt, tool_list)
    return await asyncio.to_thread(_encode, model, messages, prompt, tool_list)


def check_logit_bias(model: ServedModel, sampling: dict) -> None:
    """logit_bias token ids inside the vocabulary (the engine checks again; this refuses before queueing)."""
    bias = sampling.get("logit_bias") or {}
    bad = [t for t in map(int, bias) if t >= model.vocab_size] if model.vocab_size else []
    if bad:
        raise InvalidRequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary of "
                                  f"{model.vocab_size} tokens", param="logit_bias")


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Prompt and output must fit the context (OpenAI's context_length_exceeded, a 400)."""
    if prompt_tokens >= max_model_len:
        message, param = f"the prompt has {prompt_tokens} tokens; shorten it", None
    elif max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        message, param = (f"the request needs {prompt_tokens} prompt tokens and {max_tokens} for the output; "
                          "lower max_tokens or shorten the prompt"), "max_tokens"
    else:
        return
    exc = InvalidRequestError(f"this model's maximum context length is {max_model_len} tokens, but {message}",
                              param=param)
    exc.openai_code = "context_length_exceeded"
    raise exc
