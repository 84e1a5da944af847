"""Main's side of a constrained request's grammar across the handoff.

SGLang advances a request's grammar (``req.grammar``: xgrammar, outlines, llguidance, or the
reasoning wrapper around one) over every token it samples, on the scheduler thread, and masks the
next token's logits with the state that leaves. On main, the prefill's first token and the relay's
handed tokens reach ``req.output_ids`` without being sampled there: SGLang's PD decode step that
would have accepted the first one (``process_prebuilt``) never runs for a held request, and the
extend that absorbs the handed tokens accepts only the token it samples. So before that extend
runs, main advances the grammar over every output token it has not yet accepted, as SGLang's own
result processing would have; the extend then masks the next token from the right state.

Owner: main's scheduler thread (the extend step), the thread SGLang itself advances grammars on.
"""

from __future__ import annotations

from typing import Any, Optional


def advance_over_output(req: Any, start: int) -> tuple[int, Optional[str]]:
    """Advance ``req.grammar`` over ``req.output_ids[start:]``.

    Returns ``(accepted_up_to, refusal)``: the output position the grammar has accepted up to,
    and None, or a message naming the first token the grammar refused (the request's tokens then
    break its constraint: main must not extend it). A request without a grammar accepts all."""
    grammar = req.grammar
    end = len(req.output_ids)
    if grammar is None:
        return end, None
    for position in range(start, end):
        token = int(req.output_ids[position])
        try:
            grammar.accept_token(token)
        except ValueError:  # SGLang's backends raise it for a token outside the grammar
            return position, (f"the handed-off token {token} at output position {position} is not "
                              "accepted by the request's grammar")
    return end, None
