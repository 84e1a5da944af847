"""The bench's client: closed-loop streams against one URL, timing each chunk as it arrives.

Each of ``concurrency`` workers sends a streamed /generate, reads its SSE events (only the last
chunk is parsed, for an error), and sends the next one as soon as it ends, until ``duration_s``
has passed. TTFT is request-to-first-chunk; ITL the gaps between chunks (one token a chunk).
With ``chat``, each request is an agentic chat completion instead (:func:`chat_body`: tools, an
assistant tool call and its tool result before the user's next turn), and only the chunks that
carry answer text count (a chat stream also has a role chunk and a finish chunk).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass
class LoadResult:
    ttft_s: list = field(default_factory=list)
    itl_s: list = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    error_samples: list = field(default_factory=list)
    # A PDD router's estimated prompt tokens over the servers' count, less 1, per answer.
    estimate_errors: list = field(default_factory=list)


def percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def prompt_text(tokens: int, salt: int) -> str:
    """``tokens`` words of the tiny model's vocabulary (one token each)."""
    return " ".join(f"w{(salt * 31 + i * 7) % 1000}" for i in range(tokens))


TOOLS = [{"type": "function", "function": {
    "name": "w17", "description": "w18 w19 w20",
    "parameters": {"type": "object", "properties": {"w21": {"type": "string"}},
                   "required": ["w21"]}}}]


def chat_body(prompt: str, answer_tokens: int) -> bytes:
    """A turn of an agent: the tools, the conversation so far with a tool call and its result."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "w17", "arguments": '{"w21": "w22"}'}}
    messages = [{"role": "user", "content": prompt},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "w23 w24"},
                {"role": "user", "content": "w25 w26"}]
    return orjson.dumps({"messages": messages, "tools": TOOLS, "max_tokens": answer_tokens,
                         "temperature": 0, "ignore_eos": True, "stream": True})


def _is_token_chunk(line: bytes) -> bool:
    """A chat chunk carrying answer text (not the role chunk's empty content, nor the finish)."""
    at = line.find(b'"content":"')
    return at >= 0 and line[at + 11:at + 12] != b'"'


async def _one(session, url: str, body: bytes, result: LoadResult, path: str = "/generate"
               ) -> None:
    chat = path != "/generate"
    sent = time.perf_counter()
    last_at = None
    chunks = 0
    last_line = b""
    try:
        async with session.post(url + path, data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            while True:  # one SSE event per read, not a line
                line = await resp.content.readuntil(b"\n\n")
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                if line.startswith(b"data: [DONE]"):
                    await resp.content.read()  # to the body's end: the connection is reused
                    break
                last_line = line
                if chat and not _is_token_chunk(line):
                    continue
                chunks += 1
                if last_at is None:
                    result.ttft_s.append(now - sent)
                else:
                    result.itl_s.append(now - last_at)
                last_at = now
        out = orjson.loads(last_line[5:]) if last_line else {"error": "no chunk"}
        if "error" in out:
            raise RuntimeError(str(out["error"])[:200])
        if not chat:
            _estimate_error(out.get("meta_info") or {}, result)
        result.completed += 1
        result.tokens += chunks
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as err:
        result.errors += 1
        if len(result.error_samples) < 3:
            result.error_samples.append(repr(err)[:300])


def _estimate_error(meta: dict, result: LoadResult) -> None:
    estimated = (meta.get("pdd") or {}).get("estimated_prompt_tokens")
    actual = meta.get("prompt_tokens")
    if isinstance(estimated, int) and isinstance(actual, int) and actual > 0:
        result.estimate_errors.append(abs(estimated / actual - 1))


async def run_load(url: str, concurrency: int, duration_s: float, answer_tokens: int,
                   prompt_tokens: int, max_requests: int | None = None,
                   chat: bool = False) -> LoadResult:
    result = LoadResult()
    prompts = [prompt_text(prompt_tokens, salt) for salt in range(8)]
    deadline = time.perf_counter() + duration_s
    sent = 0

    async def worker(index: int, session) -> None:
        nonlocal sent
        while time.perf_counter() < deadline and (max_requests is None or sent < max_requests):
            sent += 1
            prompt = prompts[(index + sent) % len(prompts)]
            if chat:
                await _one(session, url, chat_body(prompt, answer_tokens), result,
                           "/v1/chat/completions")
                continue
            body = orjson.dumps({"text": prompt,
                                 "sampling_params": {"max_new_tokens": answer_tokens,
                                                     "temperature": 0, "ignore_eos": True},
                                 "stream": True})
            await _one(session, url, body, result)

    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(i, session) for i in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result
