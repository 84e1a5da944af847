"""The relay -> main token-ID handoff on real SGLang processes (P, RLD, MD and a plain server).

Handoff points are forced with the relay's test-only hold (``--pdd-debug-handoff-hold`` and the
request's test control ``debug_handoff_after_tokens``, ``pdd_sglang.dev.debug_aids``): the relay
decodes to that many tokens, then waits for main out of its batch. The WAN path to main carries a
test-only delay, so main is ready late.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from pdd_sglang.protocol.messages import HandoffTokens, encode, pack_tokens
from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID, WORDS
from pdd_sglang.dev.testing.pd_client import generate_fanout, generate_pdd

MAX_NEW_TOKENS = 300
POINTS = [1, 7, 64, 65, 200]


def words(seed: int, count: int) -> list[int]:
    return [FIRST_WORD_ID + (seed * 131 + i * 7) % WORDS for i in range(count)]


def greedy(max_new_tokens: int = MAX_NEW_TOKENS, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def assert_back_to_baseline(cluster, baselines: dict) -> None:
    for name, before in baselines.items():
        after = cluster[name].wait_idle()
        assert after["in_use_tokens"] == 0 and after["locked_tokens"] == 0, (name, after)
        assert after["free_request_slots"] == before["free_request_slots"], (name, after)
        assert cluster[name].alive(), cluster[name].log_tail()
        state = cluster[name].pdd_state().get("handoff")
        if state is not None:
            assert state.get("parked", 0) == 0 and state.get("pending", 0) == 0, state
            assert state.get("active", 0) == 0 and state.get("out_of_batch", 0) == 0, state


@contextmanager
def back_to_baseline(cluster):
    """Each PDD role's pool and handoff tables as they were before, once the block is done."""
    before = {n: cluster[n].wait_idle() for n in ("prefill", "relay", "main")}
    yield before
    assert_back_to_baseline(cluster, before)


@pytest.fixture
def baselines(three_roles):
    with back_to_baseline(three_roles) as before:
        yield before


def run(cluster, body, **route):
    return generate_pdd(cluster["prefill"], cluster["relay"], cluster["main"], body,
                        cluster.bootstrap_port, **route)


@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
def test_greedy_output_is_the_plain_servers_at_every_handoff_point(three_roles, baselines, mode):
    prompt = words(3, 300)
    body = {"input_ids": prompt, "sampling_params": greedy()}
    reference = three_roles["plain"].post_json("/generate", body)["output_ids"]
    assert len(reference) == MAX_NEW_TOKENS
    main_before = three_roles["main"].pdd_state()["handoff"]["events"]
    for point in POINTS:
        answer = run(three_roles, body, debug_handoff_after_tokens=point, handoff_mode=mode)
        assert answer.get("mode") == mode, (point, answer["relay"]["meta_info"])
        handed = answer["handed_tokens"]
        # One-Shot hands exactly the forced point; Catch-Up starts there and, when main was
        # ready first, the relay keeps decoding while chunks cross.
        assert handed == point if mode == "one-shot" else handed >= point, (point, handed)
        assert answer["output_ids"] == reference, (mode, point, handed)
        relay, main = answer["relay"], answer["main"]
        # The relay streamed the first `handed` tokens, main only what came after: no position
        # twice, none missing, and main counts the handed tokens toward max_new_tokens.
        assert len(relay["output_ids"]) == handed
        assert len(main["output_ids"]) == MAX_NEW_TOKENS - handed
        assert main["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS
        assert main["meta_info"]["finish_reason"]["type"] == "length"
    events = three_roles["main"].pdd_state()["handoff"]["events"]
    absorbed = events["handoffs_absorbed"] - main_before.get("handoffs_absorbed", 0)
    extends = events["extend_batches"] - main_before.get("extend_batches", 0)
    assert absorbed == len(POINTS)
    if mode == "catch-up":
        # Chunks of 64 tokens: 65 held tokens take 2 extends, a 200-token handoff at least 4.
        assert extends >= len(POINTS) + 4
    else:
        assert extends == len(POINTS)


def test_sampling_completes_with_every_position_once(three_roles, baselines):
    total = 200
    body = {"input_ids": words(11, 200),
            "sampling_params": {"max_new_tokens": total, "temperature": 0.9, "top_p": 0.95,
                                "ignore_eos": True}}
    for point, mode in [(1, "one-shot"), (30, "catch-up"), (70, "one-shot"), (70, "catch-up")]:
        answer = run(three_roles, body, debug_handoff_after_tokens=point, handoff_mode=mode)
        handed = answer["handed_tokens"]
        assert handed is not None and handed >= point
        assert len(answer["output_ids"]) == total
        assert len(answer["main"]["output_ids"]) == total - handed
        assert answer["main"]["meta_info"]["completion_tokens"] == total
        assert answer["relay"]["output_ids"] == answer["output_ids"][:handed]


def test_payload_is_a_few_bytes_per_handed_token(three_roles, baselines):
    before = three_roles["relay"].pdd_state()["handoff"]
    body = {"input_ids": words(21, 150), "sampling_params": greedy(150)}
    answer = run(three_roles, body, debug_handoff_after_tokens=100, handoff_mode="one-shot")
    assert answer["handed_tokens"] == 100
    after = three_roles["relay"].pdd_state()["handoff"]
    payload = after["payload_bytes"] - before["payload_bytes"]
    tokens = after["handed_tokens"] - before["handed_tokens"]
    assert tokens == 100
    # The same figure from the encoder: what crossed is exactly one encoded message.
    message = HandoffTokens(room=answer["room"], seq=0, start=0,
                            token_ids=pack_tokens(answer["output_ids"][:100]), is_last=True)
    assert payload == len(encode(message))
    print(f"\nhandoff payload: {payload} B for {tokens} tokens "
          f"({(payload - 4 * tokens)} B constant + 4 B/token); the report's: ~1,500 B")
    assert payload <= 16 * tokens + 128


def first_stop_word(tokens: list[int], start: int, end: int) -> tuple[int, str]:
    """The first position in [start, end) whose word occurs nowhere earlier (not even as the
    start of a longer word), so a stop string of that word ends the output exactly there."""
    # The tiny model's tokenizer is word-level: token FIRST_WORD_ID + i is the word "w{i}".
    for position in range(start, min(end, len(tokens))):
        stop = f"w{tokens[position] - FIRST_WORD_ID}"
        if not any(f"w{t - FIRST_WORD_ID}".startswith(stop) for t in tokens[:position]):
            return position, stop
    pytest.fail(f"no usable stop word in positions {start}..{end} of {tokens}")


def test_stop_conditions_span_the_handoff(three_roles, baselines):
    """A stop string after the handoff ends the request at main; before it, at the relay."""
    prompt = words(5, 120)
    plain = three_roles["plain"]
    free_run = plain.post_json("/generate", {"input_ids": prompt, "sampling_params": greedy(60)})
    tokens = free_run["output_ids"]
    after_handoff = (first_stop_word(tokens, 20, 60), 10)
    before_handoff = (first_stop_word(tokens, 2, 30), 30)
    for (stop_at, stop), point in (after_handoff, before_handoff):
        body = {"input_ids": prompt, "sampling_params": greedy(60, stop=[stop])}
        reference = plain.post_json("/generate", body)
        assert len(reference["output_ids"]) <= stop_at + 1, (stop_at, reference)
        answer = run(three_roles, body, debug_handoff_after_tokens=point,
                     handoff_mode="one-shot")
        assert answer["output_ids"] == reference["output_ids"], (stop_at, point)
        if stop_at > point:
            assert answer["handed_tokens"] == point
            assert answer["main"]["meta_info"]["finish_reason"]["type"] == "stop"
        else:
            assert answer["handed_tokens"] is None  # the relay finished it: exactly once
            assert answer["relay"]["meta_info"]["finish_reason"]["type"] == "stop"


def test_singular_filter_cancels_the_wan_copy(three_roles, baselines):
    """The relay answers before main's KV arrives: the client gets the relay's answer, main's
    copy is aborted, and prefill drops the WAN chunks not yet sent.

    Dropping needs the abort to reach prefill within the WAN path's debug delay (WAN_DELAY_MS
    per chunk); on a machine busy with the background suites the relay's one token can take
    longer, and then the copy has crossed whole. Three prompts at most: one must be cut short."""
    page = three_roles.page_size
    crossed = []
    for seed in (31, 32, 33):
        prompt = words(seed, 1500)
        body = {"input_ids": prompt, "sampling_params": greedy(1)}
        reference = three_roles["plain"].post_json("/generate", body)["output_ids"]
        answer = run(three_roles, body)
        assert answer["handed_tokens"] is None
        assert answer["output_ids"] == reference
        suffix_bytes = -(-len(prompt) // page) * page * 512
        rows = [r for r in three_roles["prefill"].pdd_state()["transfers"]["by_request"]
                if r["room"] == answer["room"] and r["role"] == "main"]
        crossed.append((sum(r["bytes"] for r in rows), suffix_bytes))
        print(f"\nsingular: {crossed[-1][0]} of {suffix_bytes} B of main's suffix crossed the WAN")
        if crossed[-1][0] < suffix_bytes:
            break
    assert crossed[-1][0] < crossed[-1][1], f"every copy crossed whole: {crossed}"
    # Main's aborted copies left its staging once SGLang cleared their receivers (issue 50: the
    # landing thread lets a room go before its pages go elsewhere).
    main = three_roles["main"]
    main.wait_idle()
    staging = main.pdd_state().get("wan_staging")
    assert staging is None or staging["rooms"] == 0, staging


def _counts(cluster, name: str, kind: str) -> dict:
    return dict(cluster[name].pdd_state()["handoff"][kind])


def test_main_wan_copy_is_checked_against_the_relays_and_a_damaged_one_never_serves(
        three_roles, baselines):
    """--pdd-enable-kv-digest: main's digest of the KV it received travels in HandoffReady; the
    relay checks it against its own copy. Damaged (one value changed, as by a flipped bit on the
    line): the relay answers the whole request, main drops its copy and caches none of it."""
    def control(seed: int) -> list[int]:
        return words(seed, 200)

    # A sound copy: verified, then handed off as usual.
    verified_before = _counts(three_roles, "relay", "events").get("kv_digest_verified", 0)
    body = {"input_ids": control(51), "sampling_params": greedy(40)}
    reference = three_roles["plain"].post_json("/generate", body)["output_ids"]
    answer = run(three_roles, body, debug_handoff_after_tokens=3)
    assert answer["handed_tokens"] == 3 and answer["output_ids"] == reference
    assert _counts(three_roles, "relay", "events")["kv_digest_verified"] == verified_before + 1

    # A damaged copy.
    refused_before = _counts(three_roles, "relay", "refused").get("kv_digest_mismatch", 0)
    dropped_before = _counts(three_roles, "main", "events").get(
        "relay_refused_kv_digest_mismatch", 0)
    body = {"input_ids": control(52), "sampling_params": greedy(40)}
    reference = three_roles["plain"].post_json("/generate", body)["output_ids"]
    answer = run(three_roles, body, keep_main_copy=True, debug_corrupt_wan_kv=True)
    assert answer["handed_tokens"] is None  # the relay answered alone...
    assert answer["output_ids"] == reference  # ...the whole, correct answer
    assert isinstance(answer["main"], Exception), answer["main"]  # main dropped its copy
    assert _counts(three_roles, "relay", "refused")["kv_digest_mismatch"] == refused_before + 1
    assert _counts(three_roles, "main", "events")[
        "relay_refused_kv_digest_mismatch"] == dropped_before + 1
    # Nothing of the damaged copy entered main's cache: the same prompt again, P->MD, crosses
    # whole. (meta_info's cached_tokens is prefill's hit in SGLang PD; prefill's transfer
    # accounting shows what main was sent, so what it lacked.)
    again = generate_fanout(three_roles["prefill"], [three_roles["main"]],
                            {**body, "sampling_params": greedy(1)},
                            three_roles.bootstrap_port, "prefill_main")["main"]
    rows = [r for r in three_roles["prefill"].pdd_state()["transfers"]["by_request"]
            if r["room"] == again["bootstrap_room"] and r["role"] == "main"]
    page = three_roles.page_size
    assert sum(r["pages"] for r in rows) == -(-len(body["input_ids"]) // page), rows


def test_concurrent_handoffs_under_load_splice_consistently(three_roles, baselines):
    """Handoffs as traffic makes them (no forced point): several P->RLD->MD requests at once,
    256-768-token outputs, greedy and sampled, main's copy late, so the relay runs ahead and
    Catch-Ups happen while it keeps decoding. Every answer splices as the router splices it:
    the relay streamed exactly what it handed, main's stream starts right after (SGLang's
    completion_tokens counts the handed tokens), greedy answers are the plain server's; at least
    one request hands off (the others may finish at the relay first)."""
    import concurrent.futures
    import random

    rng = random.Random(16)
    cases = []
    for index in range(8):
        sampled = index % 2 == 1
        # Long enough that the relay is still decoding when main's copies land even on a quiet
        # machine: with 64-256 tokens an idle relay once finished all eight first (page 16).
        params = {"max_new_tokens": rng.choice([96, 256, 512, 768]), "ignore_eos": True,
                  "temperature": 0.8 if sampled else 0.0}
        if sampled:
            params["sampling_seed"] = 1000 + index
        # Main's copy is late (each KV chunk 300 ms on the WAN), so the relay runs ahead; longer
        # prompts (1,200-2,000 tokens at page 16) make it finish before main is ready.
        cases.append({"input_ids": words(60 + index, rng.choice([150, 300, 600])),
                      "sampling_params": params})
    references = [None if c["sampling_params"]["temperature"] else
                  three_roles["plain"].post_json("/generate", c)["output_ids"] for c in cases]
    relay_before = three_roles["relay"].pdd_state()["handoff"]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: run(three_roles, c), cases))
    outcomes = []
    for case, reference, answer in zip(cases, references, answers):
        total = case["sampling_params"]["max_new_tokens"]
        handed = answer["handed_tokens"]
        outcomes.append((answer.get("mode"), handed))
        assert len(answer["output_ids"]) == total, (handed, answer["relay"]["meta_info"])
        if handed is not None:
            relay, main = answer["relay"], answer["main"]
            assert len(relay["output_ids"]) == handed, (handed, len(relay["output_ids"]))
            assert main["meta_info"]["completion_tokens"] - len(main["output_ids"]) == handed, (
                handed, main["meta_info"]["completion_tokens"], len(main["output_ids"]))
        if reference is not None:
            assert answer["output_ids"] == reference, (handed, answer.get("mode"))
    # --pdd-enable-kv-digest is on: every main copy that crossed matched the relay's, so a
    # divergence here could not come from damaged KV.
    relay_after = three_roles["relay"].pdd_state()["handoff"]
    verified = (relay_after["events"].get("kv_digest_verified", 0)
                - relay_before["events"].get("kv_digest_verified", 0))
    assert relay_after["refused"].get("kv_digest_mismatch", 0) == relay_before["refused"].get(
        "kv_digest_mismatch", 0)
    print(f"\nunforced handoffs (mode, handed): {outcomes}; KV digests verified: {verified}")
    assert any(handed for _, handed in outcomes), outcomes  # the case under test happened
    # --enable-metrics: main's handoff latencies as Prometheus histograms.
    import urllib.request

    with urllib.request.urlopen(three_roles["main"].url + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    for name in ("sglang:pdd_handoff_latency_seconds_bucket",
                 "sglang:pdd_handoff_duration_seconds_count"):
        assert name in metrics, name
