"""prompt_cache_key over the real stack: openai client -> gateway -> queue -> router -> two decode workers.

Each decode worker prefills its own prompts (no prefill worker), so a conversation's
history is cached only on the decode worker its last turn ran on. With a key every turn
goes to that worker and finds the history; the user sees it in ``cached_tokens``.
"""

from __future__ import annotations

import pytest
import redis

from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the workers' default block size


@pytest.fixture(scope="module")
def stack(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    spec = StackSpec(prefill=0, decode=2, dtype="fp32", threads=1, kv_cache_gb=0.1, redis_url=redis_url)
    with LocalStack(spec) as s:
        yield s


def test_a_conversations_turns_find_their_history_with_a_key(stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{stack.gateway_address}/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 8}]
    previous_prompt = 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: name a colour of the sky."})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                               prompt_cache_key="conversation-42")
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens
        if turn:
            # every full block of the previous turn's prompt is cached on the worker the key chose;
            # without the key each turn goes to the worker with fewer requests and more free blocks,
            # which after one turn is the other one
            assert cached >= previous_prompt // BLOCK * BLOCK, (turn, cached, previous_prompt)
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
