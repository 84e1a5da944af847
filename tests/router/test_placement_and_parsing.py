"""Placement glue (mirror + load -> policy) and request parsing, with no servers."""

from __future__ import annotations

import pytest

from pdd_sglang import policy
from pdd_sglang.router.config import LinkParams, PrefillEndpoint, RouterConfig, parse_args
from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.model import ModelInfo, kv_bytes_per_token_from_config
from pdd_sglang.router.placement import Placer
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.prompt import Prompt, TokenEstimate
from pdd_sglang.router.chat_translation import job_of, parse_chat
from pdd_sglang.router.request_parsing import parse_completion, parse_generate
from pdd_sglang.router.servers import NoHealthyServer, ServerPool

KV = 512.0
# 100 uncached tokens of 512 B take 0.5 s: the policy's default boundary.
LINK = LinkParams(wan_bytes_per_s=100 * KV / 0.5, rtt_s=0.0)


def make(mains=("http://m1", "http://m2"), relays=("http://r1",), penalty=8192):
    pool = ServerPool([PrefillEndpoint("http://p1", 9000), PrefillEndpoint("http://p2", 9001)],
                      relays, mains)
    for upstream in pool.all():
        upstream.max_running_requests = 4
    for number, relay in enumerate(pool.by_role["relay"]):
        relay.control_address = f"tcp://127.0.0.1:{7000 + number}"
    mirrors = {url: PrefixMirror(10**6) for url in mains}
    config = RouterConfig(prefills=(), mains=mains, relays=relays, link=LINK,
                          policy=policy.PolicyConfig(main_load_penalty_tokens=penalty),
                          placement="idle-line")
    return pool, mirrors, Placer(pool, mirrors, config, KV)


def place(placer, ids, *args, **kwargs):
    return placer.place(Prompt.of_ids(ids), *args, **kwargs)


def test_pipeline_follows_uncached_suffix_size():
    pool, mirrors, placer = make()
    prompt = list(range(300))
    first = place(placer, prompt, 16)
    assert first.pipeline is policy.Pipeline.PREFILL_RELAY_MAIN and first.relay is not None
    assert first.route_name == "prefill_relay_main"
    assert first.route_fields == {"relay_control": "tcp://127.0.0.1:7000"}
    mirrors[first.main.url].insert(prompt + [7, 8])
    # The next turn re-sends the history plus 30 new tokens: 30 uncached -> P->MD, same main.
    second = place(placer, prompt + [7, 8] + list(range(1000, 1030)), 16)
    assert second.pipeline is policy.Pipeline.PREFILL_MAIN and second.relay is None
    assert second.main is first.main and second.main_cached_tokens == 302


def test_main_choice_weighs_cache_against_load():
    pool, mirrors, placer = make(penalty=100)
    prompt = list(range(500))
    mirrors["http://m2"].insert(prompt[:400])
    assert place(placer, prompt, 8).main.url == "http://m2"
    m2 = pool.by_role["main"][1]
    m2.outstanding = 4  # full: only used when every main is
    assert place(placer, prompt, 8).main.url == "http://m1"


def test_prefill_and_relay_by_outstanding_requests_and_health():
    pool, _, placer = make(relays=("http://r1", "http://r2"))
    pool.by_role["prefill"][0].outstanding = 2
    pool.by_role["relay"][0].outstanding = 1
    placement = place(placer, list(range(400)), 8)
    assert placement.prefill.url == "http://p2" and placement.prefill.bootstrap_port == 9001
    assert placement.relay.url == "http://r2"
    pool.by_role["prefill"][1].healthy = False
    assert place(placer, list(range(400)), 8).prefill.url == "http://p1"


def test_no_healthy_relay_falls_back_to_prefill_main():
    pool, _, placer = make()
    pool.by_role["relay"][0].healthy = False
    placement = place(placer, list(range(400)), 8)
    assert placement.pipeline is policy.Pipeline.PREFILL_MAIN and placement.relay_fallback


def test_no_healthy_main_falls_back_to_the_relay_alone():
    pool, _, placer = make()
    for main in pool.by_role["main"]:
        main.healthy = False
    for prompt in ([1, 2, 3], list(range(400))):  # whatever the pipeline would have been
        placement = place(placer, prompt, 8)
        assert placement.pipeline is policy.Pipeline.RELAY_SINGULAR and placement.main_fallback
        assert placement.main is None and placement.relay.url == "http://r1"


def test_no_healthy_main_and_no_relay_is_refused_for_want_of_a_main():
    pool, _, placer = make()
    for server in pool.by_role["main"] + pool.by_role["relay"]:
        server.healthy = False
    with pytest.raises(NoHealthyServer) as err:
        place(placer, [1, 2, 3], 8)
    assert err.value.role == "main"


def test_command_line_takes_prefill_bootstrap_ports_like_sglang_router():
    cfg = parse_args(["--prefill", "http://a:1", "9100", "http://b:2", "--relay", "http://r:3",
                      "--main", "http://m:4", "http://m:5", "--wan-gbps", "8"])
    assert [(p.url, p.bootstrap_port) for p in cfg.prefills] == [("http://a:1", 9100),
                                                                 ("http://b:2", 8998)]
    assert cfg.mains == ("http://m:4", "http://m:5") and cfg.relays == ("http://r:3",)
    assert cfg.link.wan_bytes_per_s == 1e9


def test_kv_bytes_per_token_from_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"hidden_size": 64, "torch_dtype": "float32"}')
    assert kv_bytes_per_token_from_config(str(tmp_path), None) == 512
    assert kv_bytes_per_token_from_config(str(tmp_path), "bfloat16") == 256


class WordTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) + 4 for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i - 4}" for i in ids)


MODEL = ModelInfo("/m/tiny", "/m/tiny", 100, WordTokenizer(), KV)


def rejected(parse, body) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        parse(body, MODEL)
    return info.value


def test_generate_parsing_and_sglang_messages():
    job = parse_generate({"text": "w1 w2", "sampling_params": {"max_new_tokens": 3},
                          "stream": True, "return_logprob": False, "rid": "x"}, MODEL)
    assert job.prompt.text == "w1 w2" and not job.prompt.exact  # the servers tokenize it
    assert job.stream and job.max_new_tokens == 3
    assert job.extra == {"return_logprob": False}  # rid and stream are the router's
    assert parse_generate({"input_ids": [5]}, MODEL).max_new_tokens == 128
    assert rejected(parse_generate, {"input_ids": []}).cause == "empty_prompt"
    err = rejected(parse_generate, {"input_ids": [5], "sampling_params": {"max_new_tokens": -1}})
    assert err.message == "max_new_tokens must be at least 0, got -1." and err.kind == "refused"
    err = rejected(parse_generate, {"input_ids": [5] * 100})
    assert err.message == ("The input (100 tokens) is longer than the model's context length "
                           "(100 tokens).")
    err = rejected(parse_generate, {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 91}})
    assert err.cause == "max_tokens_too_large" and "a total of 101 tokens" in err.message
    assert rejected(parse_generate, {"input_ids": "abc"}).kind == "validation"
    assert rejected(parse_generate, {"text": ["a", "b"]}).cause == "batch_unsupported"


def test_openai_parsing():
    job, name = parse_completion({"prompt": "w1 w2 w3", "temperature": 0, "stop": "w9"}, MODEL)
    assert name == "default" and job.prompt.text == "w1 w2 w3"
    assert job.sampling_params["max_new_tokens"] == 16  # SGLang's completions default
    assert job.sampling_params["stop"] == ["w9"] and job.sampling_params["temperature"] == 0
    assert rejected(parse_completion, {"prompt": ""}).message == "Prompt cannot be empty"
    assert rejected(parse_completion, {"prompt": "w1", "max_tokens": 0}).kind == "validation"
    err = rejected(parse_completion, {"prompt": "w1", "model": "other"})
    assert err.status == 404 and err.kind == "not_found"
    intake = parse_chat({"messages": [{"role": "user", "content": "w1"}],
                         "max_completion_tokens": 4, "model": "/m/tiny"}, MODEL)
    assert intake.model_name == "/m/tiny" and not intake.stream
    # SGLang's translation (a prefill's /pdd/chat_request) becomes the job: its exact ids, its
    # sampling parameters (Nones too, as SGLang sends them), its other /generate fields.
    translated = {"prompt": {"input_ids": [3, 5, 3]},
                  "sampling_params": {"max_new_tokens": 4, "stop": None, "temperature": 1.0},
                  "generate": {"require_reasoning": True}, "answer": {}}
    job = job_of(translated, intake, MODEL)
    assert job.prompt.ids == (3, 5, 3) and job.max_new_tokens == 4
    assert job.sampling_params == translated["sampling_params"]
    assert job.extra == {"require_reasoning": True}
    translated["prompt"]["input_ids"] = [5] * 97
    assert rejected(lambda body, model: job_of(body, intake, model),
                    translated).cause == "max_tokens_too_large"
    err = rejected(parse_chat, {"messages": [{"role": "user", "content": "w1"}], "n": 2})
    assert err.cause == "unsupported_n" and err.message.startswith("n is not supported")


def test_a_relay_that_failed_the_request_is_avoided_when_it_is_placed_again():
    pool, _, placer = make(relays=("http://r1", "http://r2"))
    prompt = list(range(300))
    r1, r2 = pool.by_role["relay"]
    assert place(placer, prompt, 16).relay is r1
    assert place(placer, prompt, 16, avoid=frozenset({r1})).relay is r2
    neither = place(placer, prompt, 16, avoid=frozenset({r1, r2}))
    assert neither.pipeline is policy.Pipeline.PREFILL_MAIN and neither.relay_fallback


class SlowTokenizer(WordTokenizer):
    """Encodes like WordTokenizer, taking ``delay_s`` without holding the GIL (as Hugging Face's
    fast tokenizers do)."""

    delay_s = 0.3

    def encode(self, text, add_special_tokens=True):
        import time
        time.sleep(self.delay_s)
        return super().encode(text, add_special_tokens)


def test_a_long_prompt_is_tokenized_off_the_event_loop():
    import asyncio

    from pdd_sglang.router.request_parsing import OFF_LOOP_MIN_CHARS, parse_off_loop
    # A context the text could reach: its tokens are counted, exactly.
    model = ModelInfo("/m/tiny", "/m/tiny", OFF_LOOP_MIN_CHARS, SlowTokenizer(), KV)
    long_text = "w1 " * (OFF_LOOP_MIN_CHARS // 3 + 1)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        job = await parse_off_loop(parse_generate, {"text": long_text}, model)
        before = ticks
        short = await parse_off_loop(parse_generate, {"text": "w1 w2",  # on the loop
                                                      "sampling_params": {
                                                          "max_new_tokens": OFF_LOOP_MIN_CHARS
                                                          - 10}},
                                     model)
        task.cancel()
        return job, before, ticks - before, short

    job, ticks_long, ticks_short, short = asyncio.run(main())
    assert job.prompt.ids == (5,) * (OFF_LOOP_MIN_CHARS // 3 + 1) and short.prompt.ids == (5, 6)
    assert ticks_long >= 10  # the loop kept running through the 0.3 s encode
    assert ticks_short <= 1  # a short prompt is encoded inline: the loop waited for it


def test_ttft_budget_places_by_predicted_ttft_through_main_and_counts_overruns():
    from dataclasses import replace
    pool, mirrors, placer = make()
    # 2,000 tokens/s of prefill: 300 uncached tokens are 0.15 s of prefill, 1.5 s of WAN.
    placer.cfg = replace(placer.cfg, prefill_tokens_per_s=2000.0, ttft_slo_s=2.0)
    prompt = list(range(300))
    roomy = place(placer, prompt, 16)
    assert roomy.pipeline is policy.Pipeline.PREFILL_MAIN and roomy.ttft_budget == "within"
    assert roomy.predicted_main_ttft_s == pytest.approx(0.15 + 1.5, rel=0.01)
    tight = place(placer, prompt, 16, ttft_slo_s=1.0)  # the request's own budget wins
    assert tight.pipeline is policy.Pipeline.PREFILL_RELAY_MAIN and tight.ttft_budget == "within"
    relay = pool.by_role["relay"][0]
    relay.outstanding = relay.max_running_requests  # the relay is full
    full = place(placer, prompt, 16, ttft_slo_s=1.0)
    assert full.pipeline is policy.Pipeline.PREFILL_MAIN and full.ttft_budget == "over"
    # Queued work at the prefill counts: 4 requests of ~300 tokens ahead push main past 2 s.
    relay.outstanding = 0
    for p in pool.by_role["prefill"]:
        p.outstanding = 4
    placer._mean_uncached = 300.0
    queued = place(placer, prompt, 16)
    assert queued.pipeline is policy.Pipeline.PREFILL_RELAY_MAIN
    assert queued.predicted_main_ttft_s == pytest.approx(0.6 + 0.15 + 1.5, rel=0.01)


def test_without_a_budget_placement_is_unchanged():
    _, _, placer = make()
    placed = place(placer, list(range(300)), 16)
    assert placed.pipeline is policy.Pipeline.PREFILL_RELAY_MAIN
    assert placed.ttft_budget == "no_budget" and placed.predicted_main_ttft_s is None


@pytest.mark.parametrize("value", [0, -5, "100", True])
def test_a_bad_ttft_budget_in_a_request_is_refused(value):
    assert rejected(parse_generate, {"text": "w1", "ttft_slo_ms": value}).cause == "bad_field"


def test_a_request_budget_is_parsed_for_every_api_and_not_forwarded():
    job = parse_generate({"text": "w1 w2", "ttft_slo_ms": 800}, MODEL)
    assert job.ttft_slo_s == 0.8 and "ttft_slo_ms" not in job.extra
    job, _ = parse_completion({"prompt": "w1", "ttft_slo_ms": 250}, MODEL)
    assert job.ttft_slo_s == 0.25
    intake = parse_chat({"messages": [{"role": "user", "content": "w1"}], "ttft_slo_ms": 1500},
                        MODEL)
    translated = {"prompt": {"input_ids": [5]}, "sampling_params": {}, "generate": {}}
    assert job_of(translated, intake, MODEL).ttft_slo_s == 1.5
    assert parse_generate({"text": "w1"}, MODEL).ttft_slo_s is None


def test_ttft_slo_flag():
    cfg = parse_args(["--prefill", "http://p", "--main", "http://m", "--ttft-slo-ms", "1200",
                      "--prefill-tokens-per-s", "5000"])
    assert cfg.policy.ttft_slo_s == 1.2 and cfg.policy.prefill_tokens_per_s == 5000
    assert parse_args(["--prefill", "http://p", "--main", "http://m"]).policy.ttft_slo_s is None
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://p", "--main", "http://m", "--ttft-slo-ms", "0"])


def test_a_text_prompt_is_forwarded_with_an_estimated_count_unless_it_could_reach_the_context():
    model = ModelInfo("/m/tiny", "/m/tiny", 100, WordTokenizer(), KV,
                      TokenEstimate(tokens_per_byte=0.5, specials=1))
    text = "w1 w2 w3 w4"  # 11 bytes: at most 11 + 1 + 8 = 20 tokens with any tokenizer
    job = parse_generate({"text": text, "sampling_params": {"max_new_tokens": 80}}, model)
    assert job.prompt == Prompt(1 + 6, text=text) and job.prompt.body_fields() == {"text": text}
    # Could reach the context with the tokens asked for: counted, exactly, and sent as ids.
    job = parse_generate({"text": text, "sampling_params": {"max_new_tokens": 81}}, model)
    assert job.prompt.exact and job.prompt.body_fields() == {"input_ids": [5, 6, 7, 8]}
    err = rejected(parse_generate, {"text": " ".join(["w1"] * 100)})
    assert err.message == ("The input (100 tokens) is longer than the model's context length "
                           "(100 tokens).")
    assert rejected(parse_generate, {"text": "  "}).cause == "empty_prompt"  # no token at all


def test_the_estimate_learns_tokens_per_byte_from_the_servers_counts():
    estimate = TokenEstimate(tokens_per_byte=0.25, specials=1)
    text = "w12 " * 250  # 1,000 bytes, 250 words: the servers count 251 tokens
    assert estimate.tokens(text) == 251
    for _ in range(200):
        estimate.observe(text, 201)
    assert estimate.tokens(text) == pytest.approx(201, abs=2)
    assert estimate.bound("\u00e9" * 10) == 20 + 1 + 8  # two UTF-8 bytes a character


def test_a_text_prompts_prefix_counts_in_proportion_and_placement_uses_it():
    pool, mirrors, placer = make()
    history = "w1 " * 200
    prompt = Prompt(400, text=history + "w2 " * 50)  # 750 characters, 400 tokens
    assert prompt.tokens_of(600) == 320 and prompt.key_length_of(320) == 600
    mirrors["http://m2"].insert(history)
    placement = placer.place(prompt, 16)
    assert placement.main.url == "http://m2" and placement.main_cached_tokens == 320


def test_no_rid_the_router_makes_is_a_prefix_of_another():
    """SGLang aborts every request whose rid starts with the one it is told (the contract test
    pins it): before RID_END, aborting the router's request 2 aborted its requests 20-29 too."""
    from pdd_sglang.router import attempt

    made = {attempt.new_rid() for _ in range(250)}
    assert len(made) == 250
    assert not [rid for rid in made for cut in range(1, len(rid)) if rid[:cut] in made]
