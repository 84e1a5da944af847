"""The router bench's profile (pdd_sglang/dev/router_bench/profiling.py): py-spy's raw output
reduced to buckets and top functions, on a canned sample; and py-spy attached to a live process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from pdd_sglang.dev.router_bench import profiling
from pdd_sglang.dev.router_bench.profiling import (
    BUCKETS, Frame, Sampler, bucket_of, complete, module_of, parse_raw, profile_table, summarize,
)

LIB = "/usr/lib/python3.11"
SITE = "/root/venv/lib/python3.11/site-packages"
REPO = "/work/main"
LOOP = (f"<module> ({REPO}/pdd_sglang/router/__main__.py:74);run ({LIB}/asyncio/runners.py:118);"
        f"run_forever ({LIB}/asyncio/base_events.py:607)")
CB = f"{LOOP};_run_once ({LIB}/asyncio/base_events.py:1922);_run ({LIB}/asyncio/events.py:80)"
HANDLER = (f"{CB};_handle_request ({SITE}/aiohttp/web_protocol.py:480);"
           f"generate ({REPO}/pdd_sglang/router/app.py:60);"
           f"run ({REPO}/pdd_sglang/router/dispatch.py:120)")
# Root first, one distinct stack per line, its sample count last (py-spy --format raw).
CANNED = "\n".join([
    f"{LOOP};_run_once ({LIB}/asyncio/base_events.py:1922) 30",  # the loop itself
    f"{HANDLER};step ({REPO}/pdd_sglang/router/detokenize.py:50);"
    f"decode ({SITE}/transformers/tokenization_utils_base.py:3800) 10",  # tokenizer under detok
    f"{HANDLER};feed ({REPO}/pdd_sglang/router/splice.py:100);"
    "__init__ (<string>:3) 15",  # a dataclass __init__ passes the sample on to splice
    f"{HANDLER};place ({REPO}/pdd_sglang/router/placement.py:90);"
    f"match ({REPO}/pdd_sglang/router/prefix_mirror.py:70) 12",
    f"{CB};poll_prefill_lines ({REPO}/pdd_sglang/router/line_state.py:188);"
    f"read_line_report ({REPO}/pdd_sglang/router/line_state.py:170);"
    f"loads ({LIB}/json/__init__.py:346);decode ({LIB}/json/decoder.py:337) 8",
    f"{HANDLER};write ({SITE}/aiohttp/web_response.py:700) 20",
    f"{HANDLER} 5",  # the dispatcher's own line
    f"{HANDLER};write ({SITE}/aiohttp/http_writer.py:100);"
    f"_SelectorSocketTransport.write ({LIB}/asyncio/selector_events.py:1057) 7",  # send()
    f"{LOOP};_run_once ({LIB}/asyncio/base_events.py:1922);"
    f"EpollSelector.select ({LIB}/selectors.py:468) 9",
    'process 7:"python -m x";worker (somewhere/else.py:3) 0',  # a zero count adds nothing
    "not a stack line",
])
TOTAL = 30 + 10 + 15 + 12 + 8 + 20 + 5 + 7 + 9


def test_module_names_from_full_and_short_filenames():
    assert module_of(f"{LIB}/asyncio/base_events.py") == "asyncio.base_events"
    assert module_of(f"{SITE}/aiohttp/web_protocol.py") == "aiohttp.web_protocol"
    assert module_of(f"{LIB}/json/__init__.py") == "json"
    assert module_of(f"{REPO}/pdd_sglang/router/splice.py") == "pdd_sglang.router.splice"
    assert module_of("/tmp/old-tree/pdd_sglang/router/splice.py") == "pdd_sglang.router.splice"
    assert module_of("aiohttp/web_protocol.py") == "aiohttp.web_protocol"  # py-spy's short form
    assert module_of("<string>") == "<string>"
    assert module_of("") == "?"


def test_parse_raw_reads_stacks_root_first_and_skips_junk():
    stacks = parse_raw(CANNED)
    assert len(stacks) == 10
    frames, count = stacks[0]
    assert count == 30 and frames[-1] == Frame("asyncio.base_events", "_run_once",
                                               f"{LIB}/asyncio/base_events.py", 1922)
    assert stacks[-1][0][0].module == "?"  # py-spy's process pseudo-frame


def test_buckets_go_by_the_innermost_frame_a_rule_names():
    shares = summarize(CANNED)
    assert shares["samples"] == TOTAL
    b = shares["buckets"]
    assert set(b) == set(BUCKETS)
    expect = {"event loop (asyncio, thread-pool hand-offs)": 30, "tokenization": 10, "splicing/detokenization": 15,
              "placement/policy": 12, "json": 8, "http (aiohttp client+server)": 20,
              "router (other)": 5, "socket I/O (send/recv, C HTTP parser)": 7,
              "epoll wait": 9}
    for bucket, n in expect.items():
        assert b[bucket] == round(n / TOTAL, 4), bucket
    assert b["other"] == 0 and b["line-state/health polling"] == 0
    assert sum(b.values()) == pytest.approx(1.0, abs=1e-3)


def test_top_own_and_cumulative_functions():
    shares = summarize(CANNED, top=50)
    own = dict(shares["top_own"])
    assert shares["top_own"][0] == ["asyncio.base_events:_run_once", round(30 / TOTAL, 4)]
    assert own["<string>:__init__"] == round(15 / TOTAL, 4)
    assert own["pdd_sglang.router.dispatch:run"] == round(5 / TOTAL, 4)
    cum = dict(shares["top_cumulative"])
    assert "asyncio.runners:run" not in cum  # the entry chain: under every stack
    assert cum["asyncio.events:_run"] == round((TOTAL - 30 - 9) / TOTAL, 4)  # callbacks
    assert cum["pdd_sglang.router.dispatch:run"] == round((10 + 15 + 12 + 20 + 5 + 7) / TOTAL, 4)
    assert cum["pdd_sglang.router.line_state:poll_prefill_lines"] == round(8 / TOTAL, 4)
    assert cum["asyncio.base_events:_run_once"] == 1.0
    mods = dict(shares["by_router_module"])
    assert mods["(no pdd_sglang frame)"] == round((30 + 9) / TOTAL, 4)  # __main__ is not one
    assert mods["pdd_sglang.router.line_state"] == round(8 / TOTAL, 4)
    assert len(summarize(CANNED, top=3)["top_cumulative"]) == 3
    assert summarize("")["samples"] == 0 and summarize("")["top_own"] == []


def test_a_c_call_on_the_leaf_line_decides(tmp_path):
    src = tmp_path / "pdd_sglang" / "router" / "upstream.py"
    src.parent.mkdir(parents=True)
    src.write_text("def read(data):\n    chunk = orjson.loads(data)\n"
                   "    ids = self.tokenizer.encode(text)\n    return chunk\n")
    leaf = f"{HANDLER};read ({src}:%d) 1"
    json_frames, _ = parse_raw(leaf % 2)[0]
    tok_frames, _ = parse_raw(leaf % 3)[0]
    plain_frames, _ = parse_raw(leaf % 4)[0]
    assert bucket_of(json_frames) == "json"
    assert bucket_of(tok_frames) == "tokenization"
    assert bucket_of(plain_frames) == "router (other)"
    assert bucket_of([]) == "other"


def test_table_and_entry_completion(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text(CANNED)
    entry = complete({"mode": "p_md", "build": "after", "kind": "load", "concurrency": 256,
                      "raw": str(raw), "rate_hz": 100, "duration_s": 2.0, "error": None})
    assert entry["samples"] == TOTAL and entry["active_share"] == round(TOTAL / 200, 3)
    failed = complete({"mode": "p_rld_md", "kind": "saturation", "concurrency": 256,
                       "error": "py-spy exited 1: Permission denied"})
    assert "samples" not in failed
    text = profile_table({"runs": [entry, failed]})
    assert f"| p_md | after | load | 256 | {TOTAL} |" in text
    assert "py-spy failed: py-spy exited 1" in text
    assert "asyncio.base_events:_run_once" in text


def test_py_spy_attaches_to_a_live_process(tmp_path):
    try:
        profiling.py_spy()
    except RuntimeError:
        pytest.skip("py-spy is not installed (make setup installs it)")
    script = tmp_path / "spin.py"
    script.write_text(textwrap.dedent("""
        import time
        def spin_here():
            s = 0
            for i in range(200_000):
                s += i
            return s
        end = time.monotonic() + 20
        while time.monotonic() < end:
            spin_here()
    """))
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.3)
        entry = complete(Sampler(proc.pid, tmp_path / "raw.txt", 1.0, {"kind": "t"}).start()
                         .finish())
    finally:
        proc.kill()
        proc.wait()
    assert entry["error"] is None, entry["error"]
    assert entry["samples"] > 20 and entry["py_spy_samples"] > 20
    assert any(name.endswith(":spin_here") for name, _ in entry["top_own"])
