"""A fake prefill's ``/pdd/chat_request`` (pdd_sglang.prefill.chat_request) for fake servers.

Not SGLang's translation: the router's tests and bench need an answer of the route's shape, not
its content. The prompt's ids are the tiny model's words (``w<i>`` is id ``i + 4``) of every
message's text, each tool's name and each tool call's arguments, with a turn marker per message;
the sampling parameters carry what the router reads (max_new_tokens, stop and the like).
"""

from __future__ import annotations

import json

_SAMPLING_AS_IS = ("no_stop_trim", "ignore_eos", "stop_token_ids", "top_p", "top_k")
TURN_ID = 3  # the tiny model's last special token, as a turn marker


def _word_ids(text: str) -> list[int]:
    return [int(word[1:]) + 4 for word in text.split()
            if word.startswith("w") and word[1:].isdigit()] or [4 + len(text) % 1000]


def _text_of(content) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def fake_chat_translation(body: dict) -> dict:
    ids: list[int] = []
    for tool in body.get("tools") or ():
        ids += _word_ids(str(tool.get("function", {}).get("name", "")))
    for message in body.get("messages") or ():
        ids.append(TURN_ID)
        ids += _word_ids(_text_of(message.get("content")))
        for call in message.get("tool_calls") or ():
            ids += _word_ids(json.dumps(call.get("function", {})))
    ids.append(TURN_ID)
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop")
    sampling = {"max_new_tokens": max_new, "stop": [stop] if isinstance(stop, str) else stop,
                "temperature": body.get("temperature", 1.0),
                "skip_special_tokens": body.get("skip_special_tokens", not body.get("tools")),
                **{k: body[k] for k in _SAMPLING_AS_IS if k in body}}
    answer = {"tools": list(body.get("tools") or ()), "tool_call_parsing": False,
              "force_reasoning": False, "history_tool_calls": 0, "parser_prefix": "",
              "constrained": False, "own_encoding": False, "tool_call_parser": None,
              "reasoning_parser": None}
    return {"prompt": {"input_ids": ids}, "sampling_params": sampling, "generate": {},
            "answer": answer}
