"""The PDD router in front of real SGLang servers (P, RLD, MD on the tiny model), compared token for
token with a plain single server's greedy output (same CPU args, float32)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from pdd_sglang.dev.testing.cluster import TEST_API_KEY, TEST_ROUTER_KEY, bearer
from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID, WORDS

GREEDY = {"temperature": 0.0}
# What a client of the test router sends (keys on: RouterProcess), and of a test server.
ROUTER_KEY, SERVER_KEY = bearer(TEST_ROUTER_KEY), bearer(TEST_API_KEY)
# The router_cluster fixture's link puts the pipeline boundary here (conftest.py).
ROUTER_RELAY_ABOVE_TOKENS = 100


def words(seed: int, count: int) -> list[int]:
    return [FIRST_WORD_ID + (seed * 131 + i * 7) % WORDS for i in range(count)]


def text_of(ids: list[int]) -> str:
    return " ".join(f"w{i - FIRST_WORD_ID}" for i in ids)


def post(url: str, path: str, body, timeout_s: float = 300.0,
         key: dict = ROUTER_KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json", **key})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def post_stream(url: str, path: str, body: dict, timeout_s: float = 300.0,
                key: dict = ROUTER_KEY) -> list[dict]:
    """Every SSE data payload but [DONE], which must end the stream."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **key})
    events = []
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        assert resp.status == 200
        for line in resp:
            line = line.strip()
            if line.startswith(b"data:"):
                events.append(line[5:].strip())
    assert events and events[-1] == b"[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def metric(router_url: str, name: str, **labels) -> float:
    with urllib.request.urlopen(router_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_idle(cluster) -> None:
    for name in ("prefill", "relay", "main"):
        pool = cluster[name].wait_idle(timeout_s=60)
        assert pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0, (name, pool)
        assert cluster[name].alive(), cluster[name].log_tail()


# Short prompts: tiny WAN copy, P->MD. Long fresh prompts: over the boundary, P->RLD->MD.
CASES = [("prefill_main", 20), ("prefill_relay_main", 3 * ROUTER_RELAY_ABOVE_TOKENS)]


@pytest.mark.parametrize("pipeline,length", CASES, ids=[c[0] for c in CASES])
def test_generate_matches_plain_server_streamed_and_not(router_cluster, pipeline, length):
    prompt = words(length, length)
    router = router_cluster.router.url
    plain = router_cluster["plain"]
    sampling = {**GREEDY, "max_new_tokens": 12}
    reference = plain.post_json("/generate", {"input_ids": prompt, "sampling_params": sampling})

    status, whole = post(router, "/generate", {"input_ids": prompt, "sampling_params": sampling})
    assert status == 200, whole
    assert whole["meta_info"]["pdd"]["pipeline"] == pipeline
    assert whole["output_ids"] == reference["output_ids"]
    assert whole["text"] == reference["text"]
    assert whole["meta_info"]["completion_tokens"] == 12
    assert whole["meta_info"]["prompt_tokens"] == len(prompt)

    # A fresh prompt: the mirror now holds the first one, which would make it P->MD.
    prompt2 = words(length + 1, length)
    reference2 = plain.post_json("/generate", {"input_ids": prompt2, "sampling_params": sampling})
    chunks = post_stream(router, "/generate", {"input_ids": prompt2, "sampling_params": sampling,
                                               "stream": True})
    ids_seen = [c["output_ids"] for c in chunks]
    # Cumulative chunks, like a plain server: each extends the previous one.
    for before, after in zip(ids_seen, ids_seen[1:]):
        assert after[:len(before)] == before and len(after) > len(before)
    assert chunks[-1]["output_ids"] == reference2["output_ids"]
    assert chunks[-1]["text"] == reference2["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert chunks[-1]["meta_info"]["pdd"]["ttft_s"] > 0
    assert chunks[-1]["meta_info"]["pdd"]["pipeline"] == pipeline
    assert_idle(router_cluster)


ANSWER_TOKENS = 800


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_router_splices_a_real_handoff(router_cluster, stream):
    """A long answer on P->RLD->MD: the relay hands off to main mid-answer, and the client sees
    one stream, token for token the plain server's.

    Whether main is ready before the relay has decoded the whole answer is a race the system is
    allowed to lose (the relay then answers alone, also token for token): every attempt must be
    exact, and one of up to three different prompts must hand off. Main is ready some 0.5-1 s
    after prefill (the WAN delay is 300 ms); an idle relay decodes the tiny model at about
    2.5 ms a token, so 160 tokens (0.4 s) lost that race three times in a row once the suite's
    servers forked and the machine was quiet: ANSWER_TOKENS leaves it seconds."""
    router = router_cluster.router.url
    sampling = {**GREEDY, "max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}
    outcomes = []
    for attempt in range(3):
        prompt = words(9 + stream + 10 * attempt, 3 * ROUTER_RELAY_ABOVE_TOKENS)
        reference = router_cluster["plain"].post_json(
            "/generate", {"input_ids": prompt, "sampling_params": sampling})
        body = {"input_ids": prompt, "sampling_params": sampling, "stream": stream}
        if stream:
            chunks = post_stream(router, "/generate", body)
            for before, after in zip(chunks, chunks[1:]):
                assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
            final = chunks[-1]
        else:
            status, final = post(router, "/generate", body)
            assert status == 200, final
        pdd = final["meta_info"]["pdd"]
        assert pdd["pipeline"] == "prefill_relay_main"
        assert final["output_ids"] == reference["output_ids"]
        assert final["meta_info"]["completion_tokens"] == ANSWER_TOKENS
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": ANSWER_TOKENS}
        outcomes.append(pdd["outcome"])
        if pdd["outcome"] == "handoff":
            assert 0 < pdd["handed_tokens"] < ANSWER_TOKENS, pdd
            break
    assert outcomes[-1] == "handoff", outcomes
    assert_idle(router_cluster)


# Where the stop string's first word may be: past where main is ready (the relay has decoded some
# 200-400 tokens by then, test_router_splices_a_real_handoff), so that main matches it.
STOP_FROM_TOKEN = 550


def _first_new_word_pair(ids: list[int], start: int) -> str:
    """Two consecutive words of the answer from ``start`` on that occur nowhere before."""
    for at in range(start, len(ids) - 1):
        pair = text_of(ids[at:at + 2])
        if text_of(ids[:at + 2]).find(pair) == len(text_of(ids[:at])) + 1:
            return pair
    pytest.fail("the answer repeats every pair of words from its middle on")


@pytest.mark.parametrize("no_stop_trim", [False, True], ids=["trimmed", "no_stop_trim"])
def test_a_stop_string_main_matches_after_a_real_handoff_is_sent_once(router_cluster,
                                                                       no_stop_trim):
    """A two-word stop string that main completes after the relay handed off: the router decodes
    main's tokens itself, holds back the first word until the second shows the stop, and cuts the
    text as the plain server does (keeping the stop string with no_stop_trim); every stream gets
    each character once. Handing off is a race (see the test above): one of three prompts must."""
    router, plain = router_cluster.router.url, router_cluster["plain"]
    sampling = {**GREEDY, "max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}
    outcomes = []
    for attempt in range(3):
        prompt = words(29 + no_stop_trim + 10 * attempt, 3 * ROUTER_RELAY_ABOVE_TOKENS)
        free = plain.post_json("/generate", {"input_ids": prompt, "sampling_params": sampling})
        stop = {"stop": [_first_new_word_pair(free["output_ids"], STOP_FROM_TOKEN)],
                "no_stop_trim": no_stop_trim}
        reference = plain.post_json("/generate", {"input_ids": prompt,
                                                  "sampling_params": {**sampling, **stop}})
        assert reference["meta_info"]["finish_reason"] == {"type": "stop",
                                                           "matched": stop["stop"][0]}
        chunks = post_stream(router, "/generate", {"input_ids": prompt, "stream": True,
                                                   "sampling_params": {**sampling, **stop}})
        for before, after in zip(chunks, chunks[1:]):
            assert after["text"].startswith(before["text"]), (before["text"], after["text"])
        final = chunks[-1]
        assert final["text"] == reference["text"] and final["output_ids"] == reference["output_ids"]
        assert final["meta_info"]["finish_reason"] == reference["meta_info"]["finish_reason"]
        completion = post_stream(router, "/v1/completions", {
            "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, **stop})
        assert "".join(c["choices"][0]["text"] for c in completion if c["choices"]) == \
            reference["text"]
        outcomes.append(final["meta_info"]["pdd"]["outcome"])
        if outcomes[-1] == "handoff":
            break
    assert outcomes[-1] == "handoff", outcomes
    assert_idle(router_cluster)


def test_the_router_polls_each_prefills_compact_wan_line(router_cluster):
    """``GET /pdd/line`` (patch 0018), what the router's congestion-aware placement polls every
    second: the prefill's WAN line and mains out, as ``/server_info`` has them, from a report its
    scheduler thread never builds; only a prefill serves it, and the router never fell back."""
    prefill, main = router_cluster["prefill"], router_cluster["main"]
    status, _ = post(router_cluster.router.url, "/generate", {
        "input_ids": words(61, 3 * ROUTER_RELAY_ABOVE_TOKENS),
        "sampling_params": {**GREEDY, "max_new_tokens": 4}})
    assert status == 200
    main_session = main.pdd_state()["mooncake_session"]
    report = prefill.get_json("/pdd/line")
    assert report["version"] == "1" and 0 <= report["age_s"] < 2, report
    assert main_session in report["wan_line"], (main_session, report)
    state = prefill.pdd_state()
    assert set(report["wan_line"]) == set(state["wan_line"]), (report, state["wan_line"])
    assert report["mains_out"] == state["fanout"]["mains_out"] == []
    with pytest.raises(urllib.error.HTTPError) as refused:
        main.get_json("/pdd/line")
    assert refused.value.code == 404
    log = router_cluster.router.log_path.read_text()
    assert "reading its /server_info" not in log, log[-2000:]
    assert_idle(router_cluster)


def test_generate_text_prompt(router_cluster):
    body = {"text": text_of(words(3, 30)), "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    status, answer = post(router_cluster.router.url, "/generate", body)
    assert status == 200, answer
    reference = router_cluster["plain"].post_json("/generate", body)
    assert answer["output_ids"] == reference["output_ids"]
    assert answer["text"] == reference["text"]


@pytest.mark.parametrize("pipeline,length", [("prefill_main", 20),
                                             ("prefill_relay_main", 3 * ROUTER_RELAY_ABOVE_TOKENS)])
def test_openai_endpoints_match_plain_server(router_cluster, pipeline, length):
    router, plain = router_cluster.router.url, router_cluster["plain"].url
    for seed, (path, key) in enumerate([("/v1/completions", "prompt"),
                                        ("/v1/chat/completions", "messages")]):
        content = text_of(words(10 + seed + length, length))
        payload = content if key == "prompt" else [{"role": "user", "content": content}]
        body = {key: payload, "max_tokens": 7, "temperature": 0}
        _, reference = post(plain, path, body, key=SERVER_KEY)
        status, whole = post(router, path, body)
        assert status == 200, whole
        assert whole["metadata"]["pdd"]["pipeline"] == pipeline
        pick = (lambda c: c["text"]) if key == "prompt" else (lambda c: c["message"]["content"])
        assert pick(whole["choices"][0]) == pick(reference["choices"][0])
        assert whole["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"]
        for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert whole["usage"][field] == reference["usage"][field], field
        # Streamed: the deltas add up to the same text, usage closes the stream.
        chunks = post_stream(router, path, {**body, "stream": True,
                                            "stream_options": {"include_usage": True}})
        delta = (lambda c: c["text"]) if key == "prompt" else (
            lambda c: c["delta"].get("content") or "")
        streamed = "".join(delta(c["choices"][0]) for c in chunks if c["choices"])
        assert streamed == pick(reference["choices"][0])
        assert chunks[-1]["usage"]["completion_tokens"] == 7
    assert_idle(router_cluster)


AGENT_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}]


def _agentic_chats(length: int) -> list[dict]:
    """Chats with tools, an assistant tool call and its result, response_format and
    chat_template_kwargs (the tiny model's template renders the messages; SGLang's translation
    still turns the rest into sampling parameters)."""
    content = text_of(words(40 + length, length))
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"word": "w5"}'}}
    history = [{"role": "user", "content": content},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "w6 w7"},
               {"role": "user", "content": "w8 w9"}]
    base = {"messages": history, "max_tokens": 6, "temperature": 0}
    return [{**base, "tools": AGENT_TOOLS},
            {**base, "tools": AGENT_TOOLS, "tool_choice": "none", "logit_bias": {"7": -1.0}},
            {**base, "response_format": {"type": "json_object"}},
            {**base, "chat_template_kwargs": {"enable_thinking": False}, "top_k": 3}]


@pytest.mark.parametrize("pipeline,length", [("prefill_main", 20),
                                             ("prefill_relay_main", 3 * ROUTER_RELAY_ABOVE_TOKENS)])
def test_agentic_chats_get_sglangs_prompt_and_answer(router_cluster, pipeline, length):
    """The prefill's translation (what the router sends) has the prompt ids a plain SGLang
    server reports for the same chat, and the router's greedy answer is the plain server's."""
    router, plain = router_cluster.router.url, router_cluster["plain"].url
    prefill = router_cluster["prefill"].url
    for body in _agentic_chats(length):
        status, translated = post(prefill, "/pdd/chat_request", body, key=SERVER_KEY)
        assert status == 200, translated
        _, reference = post(plain, "/v1/chat/completions", {**body, "max_tokens": 1,
                                                             "return_prompt_token_ids": True},
                            key=SERVER_KEY)
        assert translated["prompt"]["input_ids"] == reference["choices"][0]["prompt_token_ids"]
        assert translated["sampling_params"]["max_new_tokens"] == 6
        if "logit_bias" in body:
            assert translated["sampling_params"]["logit_bias"] == body["logit_bias"]
        if "response_format" in body:
            assert translated["sampling_params"]["json_schema"] is not None
        if "top_k" in body:
            assert translated["sampling_params"]["top_k"] == 3
        if "response_format" in body:
            continue  # constrained decoding on the CPU engine: the grammar helper's part
        _, want = post(plain, "/v1/chat/completions", body, key=SERVER_KEY)
        status, got = post(router, "/v1/chat/completions", body)
        assert status == 200, got
        assert got["metadata"]["pdd"]["pipeline"] == pipeline
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    # SGLang's own refusal, passed on unchanged.
    bad = {"messages": [{"role": "user", "content": "w1"}], "tools": AGENT_TOOLS,
           "tool_choice": {"type": "function", "function": {"name": "missing"}}}
    assert post(router, "/v1/chat/completions", bad) == post(plain, "/v1/chat/completions", bad,
                                                              key=SERVER_KEY)
    assert_idle(router_cluster)


def test_models_health_metrics(router_cluster):
    router = router_cluster.router.url
    with urllib.request.urlopen(urllib.request.Request(router + "/v1/models",
                                                       headers=ROUTER_KEY)) as resp:
        models = json.loads(resp.read())
    assert models["data"][0]["root"] == str(router_cluster.model_path)
    assert models["data"][0]["max_model_len"] == 4096
    with urllib.request.urlopen(router + "/health") as resp:
        assert resp.status == 200
    with urllib.request.urlopen(router + "/ready") as resp:
        assert resp.status == 200
    assert metric(router, "pdd_router_time_to_first_token_seconds_count") > 0
    assert metric(router, "pdd_router_requests_total", pipeline="P->RLD->MD") > 0


def _error_shape(status: int, body: dict) -> tuple:
    inner = body.get("error") if isinstance(body.get("error"), dict) else body
    return status, tuple(sorted(body)), tuple(sorted(inner)), body.get("type")


LONG = list(range(FIRST_WORD_ID, FIRST_WORD_ID + 900)) * 5  # 4500 tokens > 4096 context
BAD_REQUESTS = [
    ("/generate", b"{not json"),
    ("/generate", {"input_ids": words(4, 5), "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"input_ids": words(4, 5), "sampling_params": {"max_new_tokens": 10**8}}),
    ("/generate", {"input_ids": LONG, "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": "w1 w2", "max_tokens": -3}),
    ("/v1/completions", {"prompt": "w1 w2", "max_tokens": 10**8}),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 3}),
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}],
                              "max_tokens": 10**8}),
]


def test_bad_requests_get_sglang_shapes_and_reach_no_server(router_cluster):
    router, plain = router_cluster.router.url, router_cluster["plain"].url
    ledger_before = len(router_cluster["prefill"].pdd_state()["transfers"]["by_request"])
    for path, body in BAD_REQUESTS:
        expected = _error_shape(*post(plain, path, body, key=SERVER_KEY))
        got = _error_shape(*post(router, path, body))
        assert got == expected, (path, body if isinstance(body, bytes) else str(body)[:80])
    # An empty prompt crashes SGLang 0.5.23's CPU scheduler, so the router's answer is compared
    # with the shape of SGLang's other /generate refusals, not with a plain server.
    status, answer = post(router, "/generate", {"input_ids": [], "sampling_params": {}})
    assert status == 400 and set(answer) == {"error"} and "message" in answer["error"]
    status, answer = post(router, "/v1/completions", {"model": "no-such-model", "prompt": "w1"})
    assert status == 404 and answer["type"] == "NotFoundError" and answer["code"] == 404
    # Streamed /generate refusals come inside a 200 stream, as SGLang sends them.
    chunks = post_stream(router, "/generate", {"input_ids": words(4, 5), "stream": True,
                                               "sampling_params": {"max_new_tokens": -1}})
    assert chunks[0]["error"]["code"] == 400
    assert len(router_cluster["prefill"].pdd_state()["transfers"]["by_request"]) == ledger_before
    assert_idle(router_cluster)
    assert metric(router, "pdd_router_errors_total", cause="empty_prompt") >= 1


@pytest.mark.parametrize("prompt_len", [20, 3 * ROUTER_RELAY_ABOVE_TOKENS],
                         ids=["prefill_main", "prefill_relay_main"])
def test_client_disconnect_mid_stream_frees_every_server(router_cluster, prompt_len):
    router = urllib.parse.urlparse(router_cluster.router.url)
    body = {"input_ids": words(50 + prompt_len, prompt_len), "stream": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 3000, "ignore_eos": True}}
    disconnects_before = metric(router_cluster.router.url, "pdd_router_errors_total",
                                cause="client_disconnect")
    slots_before = {n: router_cluster[n].wait_idle()["free_request_slots"]
                    for n in ("prefill", "relay", "main")}
    conn = http.client.HTTPConnection(router.hostname, router.port, timeout=120)
    conn.request("POST", "/generate", json.dumps(body),
                 {"Content-Type": "application/json", **ROUTER_KEY})
    resp = conn.getresponse()
    assert resp.status == 200
    tokens_seen = 0
    while tokens_seen < 5:
        line = resp.readline().strip()
        if line.startswith(b"data: {"):
            tokens_seen = len(json.loads(line[6:])["output_ids"])
    conn.close()  # mid-stream: 3000 tokens were asked for
    assert_idle(router_cluster)
    for name, slots in slots_before.items():
        assert router_cluster[name].wait_idle()["free_request_slots"] == slots, name
    deadline = time.monotonic() + 10
    while metric(router_cluster.router.url, "pdd_router_errors_total",
                 cause="client_disconnect") <= disconnects_before:
        assert time.monotonic() < deadline, "the router did not see the disconnect"
        time.sleep(0.2)


def test_bench_serving_through_router_has_no_errors(router_cluster, tmp_path):
    # "random" samples ShareGPT from the hub; "random-ids" is the same generator over token ids
    # and needs nothing from the network.
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", router_cluster.router.url, "--dataset-name", "random-ids",
           "--num-prompts", "8", "--random-input-len", "64", "--random-output-len", "8",
           "--tokenizer", str(router_cluster.model_path), "--model",
           str(router_cluster.model_path), "--output-file", str(out)]
    # SGLang's bench sends $OPENAI_API_KEY as its bearer key: the router's (keys on).
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OPENAI_API_KEY": TEST_ROUTER_KEY})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["completed"] == 8, record
    assert_idle(router_cluster)


def _status(url: str, path: str, headers: dict, data: bytes = None) -> tuple[int, str]:
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()


def test_keys_guard_the_router_and_its_answers_name_no_server(router_cluster, tmp_path):
    """Keys on, as every test cluster runs: a request without the router's key gets 401 and
    reaches no server; a wrong admin key cannot flush; a router without the operator setting
    names no server in its answers, /server_info, /ready or metric labels, but shows them to
    its admin key."""
    from pdd_sglang.dev.testing.wan_cluster import RouterProcess
    router = router_cluster.router.url
    ledger_before = len(router_cluster["prefill"].pdd_state()["transfers"]["by_request"])
    body = json.dumps({"input_ids": words(7, 12), "sampling_params": {"max_new_tokens": 3}})
    for headers in ({}, bearer("wrong"), SERVER_KEY):
        assert _status(router, "/generate", {"Content-Type": "application/json", **headers},
                       body.encode())[0] == 401
    assert len(router_cluster["prefill"].pdd_state()["transfers"]["by_request"]) == ledger_before
    admin = "pdd-test-admin-key"
    quiet = RouterProcess(tmp_path / "router-quiet.log", [
        "--prefill", router_cluster["prefill"].url, str(router_cluster.bootstrap_port),
        "--relay", router_cluster["relay"].url, "--main", router_cluster["main"].url,
        "--health-interval-s", "1"], expose=False)
    quiet.env["PDD_ROUTER_ADMIN_API_KEY"] = admin
    quiet.start()
    try:
        for headers in (ROUTER_KEY, bearer("wrong")):
            assert _status(quiet.url, "/flush_cache", headers, b"")[0] == 401
        status, answer = _status(quiet.url, "/generate",
                                 {"Content-Type": "application/json", **ROUTER_KEY},
                                 body.encode())
        assert status == 200 and "pdd" not in json.loads(answer)["meta_info"]
        urls = [router_cluster[n].url for n in ("prefill", "relay", "main")]
        texts = [answer] + [_status(quiet.url, path, ROUTER_KEY)[1]
                            for path in ("/server_info", "/ready", "/metrics")]
        assert not [u for u in urls for text in texts if u in text]
        admin_key = bearer(admin)
        status, answer = _status(quiet.url, "/generate",
                                 {"Content-Type": "application/json", **admin_key}, body.encode())
        assert json.loads(answer)["meta_info"]["pdd"]["main"] == router_cluster["main"].url
        assert router_cluster["main"].url in _status(quiet.url, "/server_info", admin_key)[1]
        assert _status(quiet.url, "/flush_cache", admin_key, b"")[0] == 200
    finally:
        quiet.stop()
    assert_idle(router_cluster)
