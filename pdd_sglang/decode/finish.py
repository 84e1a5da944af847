"""The finish reason a relay gives a request it handed to main."""

from __future__ import annotations

from sglang.srt.managers.schedule_batch import BaseFinishReason

from pdd_sglang.protocol.messages import HANDOFF_FINISH_TYPE


class HandedOff(BaseFinishReason):
    """The relay stopped after ``handed_tokens`` output tokens; main continues from there.

    It reaches the client as ``meta_info["finish_reason"] = {"type": "pdd_handoff",
    "handed_tokens": n, "mode": ...}``: the PDD router reads it to splice main's stream in at
    position n, and never shows it to its own clients.
    """

    def __init__(self, handed_tokens: int, mode: str):
        super().__init__()
        self.handed_tokens = handed_tokens
        self.mode = mode

    def to_json(self):
        return {"type": HANDOFF_FINISH_TYPE, "handed_tokens": self.handed_tokens,
                "mode": self.mode}
