"""A multi-turn conversation whose turns share a growing prefix, sent through a PD pair.

Each turn re-sends the whole history (system prompt, every user message and every answer) plus a
new user message, as chat and agent clients do; this is what makes a decode-side radix cache hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdd_sglang.dev.testing.cluster import SGLangServer
from pdd_sglang.dev.testing.pd_client import generate_pd

FIRST_WORD_ID = 4  # ids 0-3 are the tiny tokenizer's special tokens
WORDS = 1000


def word_ids(start: int, count: int) -> list[int]:
    return [FIRST_WORD_ID + (start + i * 7) % WORDS for i in range(count)]


@dataclass
class Turn:
    prompt: list[int]
    answer: dict
    latency_s: float
    room: int = field(init=False)

    def __post_init__(self):
        self.room = self.answer["bootstrap_room"]

    @property
    def cached_tokens(self) -> int:
        return self.answer["meta_info"]["cached_tokens"]


def run_conversation(
    prefill: SGLangServer,
    decode: SGLangServer,
    bootstrap_port: int,
    turns: int,
    system_len: int,
    user_len: int,
    max_new_tokens: int,
    seed: int = 0,
) -> list[Turn]:
    prompt = word_ids(seed * 31, system_len)
    history = []
    for turn in range(turns):
        prompt = prompt + word_ids(seed * 31 + 100 * (turn + 1), user_len)
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        }
        started = time.perf_counter()
        answer = generate_pd(prefill, decode, body, bootstrap_port)
        history.append(Turn(list(prompt), answer, time.perf_counter() - started))
        prompt = prompt + answer["output_ids"]
    return history


def sent_for_room(prefill_state: dict, room: int) -> list[dict]:
    """The prefill's transfer-ledger rows (one per destination) for one request."""
    return [row for row in prefill_state["transfers"]["by_request"] if row["room"] == room]
