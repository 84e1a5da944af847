"""An agentic multi-turn workload, driven through the PDD router with streaming, fixed seed.

Shape (the brief's premise): every conversation starts with one long shared system prompt; each
turn re-sends the whole history (system prompt, task, every tool result and every answer) plus a
short new tool result, and asks for a short answer. So most turns hit their decode side's radix
cache above 95%. A few turns append a long new document (a file read, a search dump): those are the
low-hit requests whose KV copy is large. The content of every turn is fixed by the seed; the
answers come from the model (greedy, fixed length), so two setups see the same prompts.

The client measures at its end of a streamed ``/generate``: TTFT (request sent -> first token
arrived) and the inter-token gaps (a chunk carrying k new tokens after a gap g counts k gaps of
g/k).
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

FIRST_WORD_ID = 4  # ids 0-3 are the tiny tokenizer's special tokens
WORDS = 1000


@dataclass(frozen=True)
class WorkloadSpec:
    conversations: int = 16
    turns: int = 8
    system_tokens: int = 1536
    task_tokens: tuple = (64, 192)       # first user message, per conversation
    tool_tokens: tuple = (24, 96)        # a short tool result or user follow-up, per later turn
    document_tokens: tuple = (800, 1200)  # a long new document: the low-hit turns
    document_prob: float = 0.1           # share of later turns that carry a document
    output_tokens: tuple = (8, 24)       # short answers (ignore_eos: exact lengths)
    concurrency: int = 4                 # conversations in flight at once
    seed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Conversation:
    index: int
    task: list[int]
    turns: list[tuple[list[int], int]]  # (new tokens appended before the turn, max_new_tokens)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [FIRST_WORD_ID + rng.randrange(WORDS) for _ in range(count)]


def build(spec: WorkloadSpec) -> tuple[list[int], list[Conversation]]:
    """The shared system prompt and every conversation's scripted turns."""
    rng = random.Random(spec.seed)
    system = _tokens(rng, spec.system_tokens)
    # Exactly round(document_prob x later turns) documents, at seeded places: a short run still
    # has its few low-hit turns.
    slots = [(c, t) for c in range(spec.conversations) for t in range(1, spec.turns)]
    count = min(len(slots), max(1 if spec.document_prob > 0 else 0,
                                round(spec.document_prob * len(slots))))
    documents = set(rng.sample(slots, count)) if slots else set()
    conversations = []
    for index in range(spec.conversations):
        task = _tokens(rng, rng.randint(*spec.task_tokens))
        turns = []
        for turn in range(spec.turns):
            if turn == 0:
                new = []  # the task itself is the first message
            elif (index, turn) in documents:
                new = _tokens(rng, rng.randint(*spec.document_tokens))
            else:
                new = _tokens(rng, rng.randint(*spec.tool_tokens))
            turns.append((new, rng.randint(*spec.output_tokens)))
        conversations.append(Conversation(index, task, turns))
    return system, conversations


@dataclass
class RequestResult:
    conversation: int
    turn: int
    prompt_tokens: int
    new_tokens: int
    max_new_tokens: int
    sent_at: float = 0.0
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    itl_s: list = field(default_factory=list)
    output_ids: list = field(default_factory=list)
    cached_tokens: Optional[int] = None
    pipeline: Optional[str] = None
    outcome: Optional[str] = None  # the router's: main, handoff, relay_finished, relay_lost
    handoff_mode: Optional[str] = None  # on a handoff: "one-shot" or "catch-up"
    router_ttft_s: Optional[float] = None
    rid: Optional[str] = None  # the router's request id (its log's per-request lines)
    marks: dict = field(default_factory=dict)  # the router's wall-clock marks (time.time())
    sent_ts: Optional[float] = None  # wall clock when the client sent the request
    error: Optional[str] = None

    def summary(self) -> dict:
        row = asdict(self)
        row.pop("output_ids")
        row["output_tokens"] = len(self.output_ids)
        row["itl_mean_ms"] = (sum(self.itl_s) / len(self.itl_s) * 1e3) if self.itl_s else None
        row.pop("itl_s")
        return row


def stream_generate(host: str, port: int, body: dict, timeout_s: float,
                    result: RequestResult, headers: Optional[dict] = None) -> None:
    """One streamed ``/generate``; fills ``result`` (TTFT, gaps, ids, meta) or its error.
    ``headers``: the key the router or server takes (``RouterProcess.headers``)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        payload = json.dumps({**body, "stream": True}).encode()
        result.sent_at, result.sent_ts = time.perf_counter(), time.time()
        conn.request("POST", "/generate", body=payload,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return
        seen, last_at, done, meta = 0, None, False, {}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                return
            now = time.perf_counter()
            ids = chunk.get("output_ids") or []
            meta = chunk.get("meta_info") or meta
            if len(ids) > seen:
                fresh = len(ids) - seen
                if last_at is None:
                    result.ttft_s = now - result.sent_at
                    fresh -= 1  # the first token's wait is TTFT, not an inter-token gap
                    gap_from = now
                else:
                    gap_from = last_at
                if fresh > 0 and last_at is not None:
                    result.itl_s.extend([(now - gap_from) / fresh] * fresh)
                seen, last_at = len(ids), now
                result.output_ids = list(ids)
        result.e2e_s = time.perf_counter() - result.sent_at
        if not done:
            result.error = "stream ended without [DONE]"
            return
        result.cached_tokens = meta.get("cached_tokens")
        pdd = meta.get("pdd") or {}
        result.pipeline = pdd.get("pipeline")
        result.outcome = pdd.get("outcome")
        result.handoff_mode = pdd.get("handoff_mode")
        result.router_ttft_s = pdd.get("ttft_s")
        result.marks = pdd.get("marks") or {}
        result.rid = meta.get("id")
        if len(result.output_ids) != result.max_new_tokens:
            result.error = (f"got {len(result.output_ids)} tokens, asked for "
                            f"{result.max_new_tokens}")
    except Exception as err:  # noqa: BLE001 - every failure is one counted error
        result.error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()


def run(system: list[int], conversations: list[Conversation], spec: WorkloadSpec, host: str,
        port: int, *, thread_setup: Callable[[], object] | None = None,
        on_result: Callable[[RequestResult], None] | None = None,
        should_abort: Callable[[], bool] = lambda: False,
        timeout_s: float = 300.0, headers: Optional[dict] = None) -> list[RequestResult]:
    """Run every conversation through the router at ``host:port``, ``spec.concurrency`` at a
    time, each conversation's turns in order. ``thread_setup`` returns a context manager each
    worker thread holds for its whole life (e.g. entering the client's network namespace).
    A failed turn ends its conversation (the history would be wrong)."""
    work: "queue.Queue[Conversation]" = queue.Queue()
    for conversation in conversations:
        work.put(conversation)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def worker() -> None:
        context = thread_setup() if thread_setup else None
        with context if context is not None else _null():
            while not should_abort():
                try:
                    conversation = work.get_nowait()
                except queue.Empty:
                    return
                history = system + conversation.task
                for turn, (new, max_new) in enumerate(conversation.turns):
                    if should_abort():
                        return
                    prompt = history + new
                    result = RequestResult(conversation.index, turn, len(prompt), len(new),
                                           max_new)
                    body = {"input_ids": prompt,
                            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                "ignore_eos": True}}
                    stream_generate(host, port, body, timeout_s, result, headers)
                    with lock:
                        results.append(result)
                    if on_result:
                        on_result(result)
                    if result.error:
                        break
                    history = prompt + result.output_ids

    threads = [threading.Thread(target=worker, daemon=True, name=f"client-{i}")
               for i in range(max(1, spec.concurrency))]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        if should_abort():
            break
        for thread in threads:
            thread.join(0.2)
    return sorted(results, key=lambda r: (r.conversation, r.turn))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)
