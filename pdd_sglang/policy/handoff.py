"""How the relay hands a request to main: One-Shot or Catch-Up by the relay's load, the
Catch-Up chunks, and when a relay that finished answers alone."""

from __future__ import annotations

from dataclasses import dataclass

from pdd_sglang.policy.config import (DEFAULT_POLICY, HandoffMode, PolicyConfig,
                                      _require_at_least_one, _require_non_negative)


@dataclass(frozen=True)
class RelayLoad:
    """A relay server's load as its scheduler reports it."""

    running_requests: int
    max_running_requests: int
    kv_used_tokens: int
    kv_capacity_tokens: int

    def __post_init__(self) -> None:
        _require_non_negative("running_requests", self.running_requests)
        _require_non_negative("kv_used_tokens", self.kv_used_tokens)
        _require_at_least_one("max_running_requests", self.max_running_requests)
        _require_at_least_one("kv_capacity_tokens", self.kv_capacity_tokens)

    @property
    def utilisation(self) -> float:
        """The tighter of the two limits: request slots or KV memory."""
        return max(self.running_requests / self.max_running_requests,
                   self.kv_used_tokens / self.kv_capacity_tokens)


@dataclass(frozen=True)
class HandoffChunk:
    """Token positions [start, end) of the relay's output to hand to main next."""

    start: int
    end: int
    is_last: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start




def choose_handoff_mode(tokens_held: int, relay_load: RelayLoad,
                        cfg: PolicyConfig = DEFAULT_POLICY) -> HandoffMode:
    """Pick the handoff mode when main reports it holds the prompt's KV.

    Rule: ONE_SHOT if tokens_held <= cfg.catch_up_threshold_tokens (a small extend is as cheap
    as a decode step) or if the relay's utilisation is at/above cfg.relay_load_watermark (free
    the relay slot now, accept main's one larger extend).  CATCH_UP otherwise.
    """
    _require_non_negative("tokens_held", tokens_held)
    if tokens_held <= cfg.catch_up_threshold_tokens:
        return HandoffMode.ONE_SHOT
    if relay_load.utilisation >= cfg.relay_load_watermark:
        return HandoffMode.ONE_SHOT
    return HandoffMode.CATCH_UP


def next_handoff_chunk(tokens_held: int, tokens_already_handed: int, mode: HandoffMode,
                       cfg: PolicyConfig = DEFAULT_POLICY) -> HandoffChunk:
    """The next slice of relay output to hand over.

    ONE_SHOT hands everything still unhanded and is last.  CATCH_UP hands one chunk of
    cfg.catch_up_chunk_tokens while the relay keeps decoding; once the unhanded tail fits in a
    chunk, that tail is the last chunk and the relay stops decoding.  Catch-up converges because
    main absorbs a chunk in about one extend step while the relay adds about one token per step.
    """
    _require_non_negative("tokens_held", tokens_held)
    _require_non_negative("tokens_already_handed", tokens_already_handed)
    if tokens_already_handed > tokens_held:
        raise ValueError(f"tokens_already_handed ({tokens_already_handed}) exceeds tokens_held "
                         f"({tokens_held})")
    if not isinstance(mode, HandoffMode):
        raise ValueError(f"mode must be a HandoffMode, got {mode!r}")
    remaining = tokens_held - tokens_already_handed
    if mode is HandoffMode.ONE_SHOT or remaining <= cfg.catch_up_chunk_tokens:
        return HandoffChunk(tokens_already_handed, tokens_held, True)
    return HandoffChunk(tokens_already_handed,
                        tokens_already_handed + cfg.catch_up_chunk_tokens, False)


def relay_finishes_locally(relay_finished: bool, main_ready: bool,
                           cfg: PolicyConfig = DEFAULT_POLICY) -> bool:
    """Reactive singular filter: complete at the relay and cancel the WAN copy and handoff?

    True only when the relay has produced the whole output before main holds the prompt's KV.
    Once main is ready the handoff proceeds even if the relay finishes meanwhile, so main's
    cache still receives the conversation (the pipeline still ends at main).
    """
    return bool(cfg.singular_reactive and relay_finished and not main_ready)
