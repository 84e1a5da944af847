"""The prefill's /pdd/chat_request answer (pdd_sglang.prefill.chat_request): the /generate fields
of SGLang's GenerateReqInput that the router must forward, and none it sets itself."""

from __future__ import annotations

from pdd_sglang.prefill.chat_request import non_default_fields


def test_only_fields_off_their_default_are_forwarded_and_never_the_routers_own():
    from sglang.srt.managers.io_struct import GenerateReqInput

    adapted = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4},
                               stream=True, rid="chat-1", bootstrap_room=7,
                               require_reasoning=True, priority=3, extra_key="tenant",
                               return_text_in_logprobs=True, logprob_start_len=-1)
    fields = non_default_fields(adapted)
    assert fields == {"require_reasoning": True, "priority": 3, "extra_key": "tenant"}
    assert non_default_fields(GenerateReqInput(input_ids=[1])) == {}
