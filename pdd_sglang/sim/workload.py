"""Workloads: the agentic multi-turn generator and the reader for the Mooncake jsonl trace.

A request carries its prompt as chained 512-token block ids (equal id = equal prefix), so prefix
hits come out of the caches in the simulator rather than being drawn as numbers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .cache import BLOCK_TOKENS

TRACE_PATH = Path("/work/shared/traces/conversation_trace.jsonl")


@dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prompt_blocks: tuple          # block ids covering the prompt (last one may be partial)
    context_blocks: tuple         # full blocks of prompt + output, what a decoder caches after
    conversation_id: int = -1

    def __post_init__(self):
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.request_id}: input and output must be >= 1 token")


@dataclass(frozen=True)
class AgenticConfig:
    """An agentic multi-turn workload: long contexts re-sent every turn, short answers.

    Defaults give about 64K tokens per prompt, about 90% token-weighted prefix hit at prefill
    with 70-80% of requests above 95% hit, and about 70% of outputs under 500 tokens (the brief).
    Low-hit requests are first turns of new sessions and singular one-shot documents.
    """

    rate_per_s: float = 3.0
    duration_s: float = 600.0
    turns_min: int = 15
    turns_max: int = 45
    think_min_s: float = 15.0
    think_max_s: float = 45.0
    system_prompt_tokens: int = 4096          # shared by every session (tool definitions)
    first_context_min: int = 20000
    first_context_max: int = 34000
    small_delta_min: int = 100                # a tool result
    small_delta_max: int = 1200
    big_delta_probability: float = 0.15       # a file read or a long tool dump
    big_delta_min: int = 4000
    big_delta_max: int = 14000
    short_output_probability: float = 0.72
    short_output_max: int = 500
    long_output_max: int = 2000
    singular_fraction: float = 0.03           # one-shot long documents with tiny outputs
    singular_input_min: int = 56000
    singular_input_max: int = 72000
    singular_output_max: int = 32
    # Context window: a turn whose context would exceed it compacts the conversation (as coding
    # agents do): the session goes on from a fresh first context, a prefix miss past the
    # system prompt.  0: no limit.
    max_context_tokens: int = 0
    seed: int = 1


class _BlockIds:
    """Hands out fresh block ids; session streams and partial tails never collide."""

    def __init__(self, system_blocks: int):
        self.next_id = system_blocks

    def fresh(self, count: int) -> list:
        start = self.next_id
        self.next_id += count
        return list(range(start, start + count))


def _prompt_blocks(stream: list, prompt_tokens: int, ids: _BlockIds) -> tuple:
    full = prompt_tokens // BLOCK_TOKENS
    tail = ids.fresh(1) if prompt_tokens % BLOCK_TOKENS else []
    return tuple(stream[:full]) + tuple(tail)


def _extend_stream(stream: list, tokens: int, ids: _BlockIds) -> None:
    needed = tokens // BLOCK_TOKENS - len(stream)
    if needed > 0:
        stream.extend(ids.fresh(needed))


def _output_tokens(cfg: AgenticConfig, rng: random.Random) -> int:
    if rng.random() < cfg.short_output_probability:
        return rng.randint(16, cfg.short_output_max - 1)
    return rng.randint(cfg.short_output_max, cfg.long_output_max)


def generate_agentic(cfg: AgenticConfig) -> tuple[list, list]:
    """Returns (requests, warmup): requests arrive in [0, duration); warmup are earlier turns
    of sessions already running at time 0, whose blocks the simulator pre-loads into caches so
    the run starts in steady state instead of with every session new."""
    rng = random.Random(cfg.seed)
    system_blocks = cfg.system_prompt_tokens // BLOCK_TOKENS
    ids = _BlockIds(system_blocks)
    mean_turns = (cfg.turns_min + cfg.turns_max) / 2
    session_rate = cfg.rate_per_s * (1 - cfg.singular_fraction) / mean_turns
    mean_session_s = mean_turns * (cfg.think_min_s + cfg.think_max_s) / 2
    horizon_start = -2.0 * mean_session_s
    drafts = []
    session = 0
    t = horizon_start
    while True:
        t += rng.expovariate(session_rate)
        if t >= cfg.duration_s:
            break
        session += 1
        stream = list(range(system_blocks))
        context = rng.randint(cfg.first_context_min, cfg.first_context_max)
        arrival = t
        # Every turn is drawn even past the end of the run (and then dropped), so a session
        # consumes the same random numbers at any rate: a higher rate packs the same sessions
        # closer together instead of drawing different ones, and load sweeps are smooth.
        for _ in range(rng.randint(cfg.turns_min, cfg.turns_max)):
            _extend_stream(stream, context, ids)
            output = _output_tokens(cfg, rng)
            prompt = _prompt_blocks(stream, context, ids)
            _extend_stream(stream, context + output, ids)
            after = tuple(stream[:(context + output) // BLOCK_TOKENS])
            if arrival < cfg.duration_s:
                drafts.append((arrival, context, output, prompt, after, session))
            if rng.random() < cfg.big_delta_probability:
                delta = rng.randint(cfg.big_delta_min, cfg.big_delta_max)
            else:
                delta = rng.randint(cfg.small_delta_min, cfg.small_delta_max)
            context += output + delta
            if cfg.max_context_tokens and context > cfg.max_context_tokens:
                stream = list(range(system_blocks))
                context = rng.randint(cfg.first_context_min, cfg.first_context_max)
            arrival += rng.uniform(cfg.think_min_s, cfg.think_max_s)
    singular_rate = cfg.rate_per_s * cfg.singular_fraction
    rng = random.Random(cfg.seed * 7919 + 1)      # their own stream: independent of sessions
    t = 0.0
    while singular_rate > 0:
        t += rng.expovariate(singular_rate)
        if t >= cfg.duration_s:
            break
        tokens = rng.randint(cfg.singular_input_min, cfg.singular_input_max)
        stream = list(range(system_blocks))
        _extend_stream(stream, tokens, ids)
        output = rng.randint(1, cfg.singular_output_max)
        drafts.append((t, tokens, output, _prompt_blocks(stream, tokens, ids),
                       tuple(stream[:tokens // BLOCK_TOKENS]), -1))
    drafts.sort(key=lambda d: (d[0], d[5]))
    requests, warmup = [], []
    for arrival, context, output, prompt, after, session_id in drafts:
        target = requests if arrival >= 0 else warmup
        target.append(Request(len(requests) if arrival >= 0 else -1 - len(warmup), arrival,
                              context, output, prompt, after, session_id))
    return requests, warmup


TRACE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_trace(path: Path | str = TRACE_PATH, limit: int | None = None,
               max_duration_s: float | None = None) -> list:
    """Read a Mooncake-format jsonl trace: timestamp (ms), input_length, output_length, hash_ids
    (chained ids of 512-token blocks).  Rows are replayed in timestamp order from time 0.

    The trace has no ids for output blocks, so a decoder caches the prompt blocks only.
    """
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                missing = [key for key in TRACE_KEYS if key not in row]
                if missing:
                    raise ValueError(f"missing {missing}")
                rows.append((float(row["timestamp"]) / 1000.0, number,
                             max(1, int(row["input_length"])), max(1, int(row["output_length"])),
                             tuple(row["hash_ids"])))
            except (ValueError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a Mooncake trace row "
                                 f"({', '.join(TRACE_KEYS)}): {error}") from None
    rows.sort()
    start = rows[0][0] if rows else 0.0
    requests = []
    for arrival, _, input_tokens, output_tokens, blocks in rows:
        arrival -= start
        if max_duration_s is not None and arrival >= max_duration_s:
            break
        requests.append(Request(len(requests), arrival, input_tokens, output_tokens,
                                blocks, blocks))
        if limit is not None and len(requests) >= limit:
            break
    return requests


def ideal_prefix_hits(requests: Iterable[Request], warmup: Iterable[Request] = ()) -> list:
    """Per-request prefix hit with one unbounded cache of prompts (the trace's own measure)."""
    seen = set()
    for request in warmup:
        seen.update(request.prompt_blocks)
    hits = []
    for request in requests:
        count = 0
        for block in request.prompt_blocks:
            if block not in seen:
                break
            count += 1
        cached = min(count * BLOCK_TOKENS, request.input_tokens - 1)
        hits.append(cached / request.input_tokens)
        seen.update(request.prompt_blocks)
    return hits


def replay_rows(rows: Iterable[dict], system_tokens: int, block_tokens: int = 1) -> tuple:
    """(requests, warmup) replaying a measured run's per-request rows (scripts/demo.py's
    demo.json: conversation, turn, prompt_tokens, output_tokens, sent_at).

    Every conversation starts with the shared system prompt, and a turn re-sends the previous
    turn's prompt and answer, so its blocks extend the previous context's.  Arrivals are the
    measured send times: the demo's closed-loop client is replayed open-loop.  Warmup is the
    demo's one unmeasured request holding the system prompt.  block_tokens=1 matches SGLang's
    token-level radix cache on CPU (page size 1)."""
    rows = sorted(rows, key=lambda r: (r["sent_at"], r["conversation"], r["turn"]))
    if not rows:
        return [], []
    system = list(range(system_tokens // block_tokens))
    next_id = [len(system)]

    def fresh(count):
        start = next_id[0]
        next_id[0] += count
        return list(range(start, start + count))

    streams: dict = {}
    start = rows[0]["sent_at"]
    requests = []
    for row in rows:
        stream = streams.setdefault(row["conversation"], list(system))
        prompt = int(row["prompt_tokens"])
        output = int(row.get("output_tokens") or row.get("max_new_tokens") or 1)
        # a new turn's prompt diverges from the stream where its fresh tokens begin
        del stream[prompt // block_tokens:]
        stream.extend(fresh(prompt // block_tokens - len(stream)))
        tail = fresh(1) if prompt % block_tokens else []
        prompt_blocks = tuple(stream) + tuple(tail)
        stream.extend(fresh((prompt + output) // block_tokens - len(stream)))
        requests.append(Request(len(requests), row["sent_at"] - start, prompt, max(output, 1),
                                prompt_blocks, tuple(stream), int(row["conversation"])))
    warmup = [Request(-1, -1.0, max(system_tokens, 1), 1, tuple(system), tuple(system), -1)]
    return requests, warmup
