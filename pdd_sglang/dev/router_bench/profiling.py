"""Where the PDD router's CPU goes under the bench's load: py-spy samples, reduced to a few shares.

``scripts/bench_router.py --profile`` samples each PDD router while it serves the 256-stream load
run (the highest concurrency when 256 is not run) and the saturation run, then writes
``router_profile.json`` beside ``router_bench.json`` and prints a table.

Life cycle of a profile:

1. :class:`Sampler` ``.start()`` just before a run: ``py-spy record --pid PID --nonblocking
   --format raw --full-filenames`` for the run's duration (non-blocking: the router is never
   paused, so its latency is what the run measures; a few torn stacks are the price). py-spy
   leaves idle threads out: a sample is a moment a router thread was running or runnable (its
   cgroup's quota throttling it counts as runnable).
2. ``.finish()`` after the run: waits for py-spy, keeps its sample and error counts, or why it
   failed.
3. :func:`summarize` reads the raw file (one line per distinct stack, ``root;...;leaf COUNT``):
   the top functions by own samples (the leaf) and by cumulative samples (anywhere on the
   stack), the top leaf lines, the innermost router module of each sample, and one bucket per
   sample (:func:`bucket_of`).
4. :func:`write_profile` writes the entries; :func:`profile_table` prints them.

Buckets say what kind of work a sample was doing. The stack is read from the leaf up and the first
frame whose module a rule names decides (a tokenizer call made by the detokenizer is
tokenization; the detokenizer's own Python is splicing). Stdlib helpers that no rule names
(``dataclasses``, ``re``, ...) pass the sample on to their caller. py-spy sees Python frames only:
a C call (``orjson.loads``, a Rust tokenizer) shows as the Python line that makes it, so the
leaf's source line is read too and a JSON or tokenizer call on it decides (:data:`LINE_RULES`).
"""

from __future__ import annotations

import json
import linecache
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

RATE_HZ = 100
TOP = 15

# (bucket, prefixes), in the order a frame is tried against them. A prefix names a module (and
# its submodules) or, with a colon, one function (``module:Class.method``).
_SOCKET_IO = "asyncio.selector_events:_SelectorSocketTransport."
BUCKET_RULES: tuple = (
    # The send/recv system calls; a read also runs aiohttp's C HTTP parser, which py-spy cannot
    # see apart from it.
    ("socket I/O (send/recv, C HTTP parser)", (_SOCKET_IO + "write", _SOCKET_IO + "_read_ready",
                                               "asyncio.selector_events:BaseSelectorEventLoop"
                                               "._sock_connect", "socket")),
    # epoll_wait itself: handing back ready events, or a sample py-spy took as the thread went
    # to sleep (its idle check and its stack read are not one instant with --nonblocking).
    ("epoll wait", ("selectors",)),
    ("tokenization", ("transformers", "tokenizers", "sentencepiece", "tiktoken",
                      "pdd_sglang.router.model")),
    ("json", ("json", "orjson", "msgspec", "ujson", "simplejson")),
    ("http (aiohttp client+server)", ("aiohttp", "multidict", "yarl", "aiohappyeyeballs",
                                      "aiosignal", "frozenlist", "propcache", "http", "email",
                                      "urllib", "ssl")),
    ("metrics/logging", ("prometheus_client", "logging", "pdd_sglang.router.metrics")),
    ("event loop (asyncio, thread-pool hand-offs)", ("asyncio", "uvloop", "concurrent.futures",
                                                     "threading", "queue")),
    ("placement/policy", ("pdd_sglang.router.placement", "pdd_sglang.router.prefix_mirror",
                          "pdd_sglang.router.landing", "pdd_sglang.policy")),
    ("splicing/detokenization", ("pdd_sglang.router.splice", "pdd_sglang.router.detokenize",
                                 "pdd_sglang.router.resume", "pdd_sglang.router.openai_format",
                                 "pdd_sglang.router.finish_record")),
    ("line-state/health polling", ("pdd_sglang.router.line_state", "pdd_sglang.router.servers")),
    ("router (other)", ("pdd_sglang",)),
)
OTHER = "other"
BUCKETS = tuple(name for name, _ in BUCKET_RULES) + (OTHER,)
# A C call on the leaf's line: (bucket, pattern on that line's source text).
LINE_RULES: tuple = (
    ("json", re.compile(r"\b(orjson|json|msgspec|ujson)\.\w+\(|\.json\(\)")),
    ("tokenization", re.compile(r"tokeni[sz]er\w*\.\w+\(")),
)
# The process's entry chain, under every stack: left out of the cumulative top.
ENTRY_CHAIN = ("<frozen runpy>", "runpy", "asyncio.runners", "pdd_sglang.router.__main__",
               "asyncio.base_events:BaseEventLoop.run_forever",
               "asyncio.base_events:BaseEventLoop.run_until_complete")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_STDLIB = re.compile(r"/lib/python3\.\d+/(?:(?:site|dist)-packages/)?(?P<rel>.+)$")
_COUNTS = re.compile(r"Samples:\s*(\d+)\s+Errors:\s*(\d+)")


@dataclass(frozen=True)
class Frame:
    module: str
    function: str
    file: str
    line: int | None

    @property
    def name(self) -> str:
        return f"{self.module}:{self.function}"


def module_of(path: str) -> str:
    """A dotted module name for a frame's file: this package (in any checkout, so a
    ``--pdd-root-before`` tree too), site-packages and the stdlib by their package path, py-spy's
    short names (``aiohttp/web_protocol.py``) as they are."""
    if not path:
        return "?"
    rel = path
    if "/pdd_sglang/" in path:
        rel = "pdd_sglang/" + path.rsplit("/pdd_sglang/", 1)[1]
    elif "-packages/" in path:
        rel = path.rsplit("-packages/", 1)[1]
    elif (m := _STDLIB.search(path)) is not None:
        rel = m.group("rel")
    elif path.startswith("/"):
        rel = Path(path).name
    rel = rel[:-3] if rel.endswith(".py") else rel
    mod = rel.replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text.strip())
    if m is None:  # py-spy's process/thread pseudo-frames, or a torn one
        return Frame("?", text.strip(), "", None)
    line = int(m.group("line")) if m.group("line") else None
    return Frame(module_of(m.group("file")), m.group("func"), m.group("file"), line)


def parse_raw(text: str) -> list[tuple[list[Frame], int]]:
    """py-spy's raw format: ``root;...;leaf COUNT`` per line, as (frames root first, count)."""
    stacks = []
    for raw in text.splitlines():
        raw = raw.strip()
        stack, _, count = raw.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks.append(([parse_frame(f) for f in stack.split(";")], int(count)))
    return stacks


def _matches(frame: Frame, prefix: str) -> bool:
    if ":" in prefix:
        return frame.name.startswith(prefix)
    return frame.module == prefix or frame.module.startswith(prefix + ".")


def _rule_for(frame: Frame) -> str | None:
    for bucket, prefixes in BUCKET_RULES:
        if any(_matches(frame, p) for p in prefixes):
            return bucket
    return None


def _line_rule(frame: Frame) -> str | None:
    if not frame.file or frame.line is None:
        return None
    text = linecache.getline(frame.file, frame.line)
    for bucket, pattern in LINE_RULES:
        if text and pattern.search(text):
            return bucket
    return None


def bucket_of(frames: list[Frame]) -> str:
    """The kind of work one sample was doing (frames root first): see the module docstring."""
    if not frames:
        return OTHER
    leaf_line = _line_rule(frames[-1])
    if leaf_line is not None:
        return leaf_line
    for frame in reversed(frames):
        bucket = _rule_for(frame)
        if bucket is not None:
            return bucket
    return OTHER


def _shares(counter: Counter, total: int, top: int | None = None) -> list:
    return [[name, round(n / total, 4)] for name, n in counter.most_common(top)] if total else []


def summarize(raw_text: str, top: int = TOP) -> dict:
    """Shares of the samples (0..1): buckets, top own / cumulative functions (the entry chain
    left out), top leaf lines, and the innermost ``pdd_sglang`` module of each sample (not
    ``__main__``, which is under every stack of the loop)."""
    own, cum, lines, buckets, router_mod = Counter(), Counter(), Counter(), Counter(), Counter()
    total = 0
    for frames, count in parse_raw(raw_text):
        if not frames:
            continue
        total += count
        leaf = frames[-1]
        own[leaf.name] += count
        lines[f"{leaf.name}:{leaf.line}"] += count
        for name in {f.name for f in frames if not any(_matches(f, e) for e in ENTRY_CHAIN)}:
            cum[name] += count
        buckets[bucket_of(frames)] += count
        inner = next((f.module for f in reversed(frames) if f.module.startswith("pdd_sglang")
                      and not f.module.endswith("__main__")), "(no pdd_sglang frame)")
        router_mod[inner] += count
    return {
        "samples": total,
        "buckets": {b: round(buckets[b] / total, 4) if total else 0.0 for b in BUCKETS},
        "top_own": _shares(own, total, top),
        "top_cumulative": _shares(cum, total, top),
        "top_lines": _shares(lines, total, 10),
        "by_router_module": _shares(router_mod, total, 12),
    }


def py_spy() -> str:
    """The py-spy next to this interpreter (the venv's), else on PATH; a clear error if none."""
    local = Path(sys.executable).parent / "py-spy"
    found = str(local) if local.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("--profile needs py-spy (requirements/cpu.in; `make setup` installs "
                           "it, or `.venv/bin/python -m pip install py-spy`)")
    return found


@dataclass
class Sampler:
    """py-spy recording one process for one run (life cycle steps 1-2)."""
    pid: int
    out: Path
    duration_s: float
    meta: dict = field(default_factory=dict)
    rate_hz: int = RATE_HZ
    proc: subprocess.Popen | None = None
    started: float = 0.0

    def start(self) -> "Sampler":
        seconds = max(1, int(round(self.duration_s)))  # py-spy takes whole seconds
        self.duration_s = float(seconds)
        argv = [py_spy(), "record", "--pid", str(self.pid), "--duration", str(seconds),
                "--rate", str(self.rate_hz), "--format", "raw", "--full-filenames",
                "--nonblocking", "--output", str(self.out)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        return self

    def finish(self, timeout_s: float = 30.0) -> dict:
        """The entry for router_profile.json, before :func:`summarize` adds the shares."""
        entry = {**self.meta, "pid": self.pid, "raw": str(self.out), "rate_hz": self.rate_hz,
                 "duration_s": self.duration_s, "py_spy_samples": None, "py_spy_errors": None,
                 "error": None}
        try:
            output, _ = self.proc.communicate(timeout=self.duration_s + timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
            entry["error"] = "py-spy did not finish in time"
        if (m := _COUNTS.search(output or "")) is not None:
            entry["py_spy_samples"], entry["py_spy_errors"] = int(m.group(1)), int(m.group(2))
        if entry["error"] is None and (self.proc.returncode != 0 or not self.out.exists()):
            entry["error"] = (f"py-spy exited {self.proc.returncode}: "
                              f"{(output or '').strip()[-500:]}")
        return entry


def complete(entry: dict) -> dict:
    """An entry from :meth:`Sampler.finish` with its shares (after the runs: no parsing while a
    run is measured)."""
    if entry.get("error") is None:
        entry.update(summarize(Path(entry["raw"]).read_text(errors="replace")))
        expected = entry["rate_hz"] * entry["duration_s"]
        # Samples per sampling tick: 1.0 = one thread always running or runnable; more when the
        # tokenizer pool's threads ran beside the loop.
        entry["active_share"] = round(entry["samples"] / expected, 3) if expected else None
    return entry


def write_profile(entries: list, path: Path, settings: dict | None = None) -> dict:
    profile = {"tool": "py-spy record --nonblocking --format raw", "rate_hz": RATE_HZ,
               "buckets": list(BUCKETS), "settings": settings or {}, "runs": entries}
    path.write_text(json.dumps(profile, indent=1))
    return profile


def _pct(share) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def profile_table(profile: dict, top: int = TOP) -> str:
    """Buckets per run in one table, then each run's top functions."""
    runs = profile.get("runs", [])
    short = [b.split(" (")[0] for b in BUCKETS]
    head = ("mode", "build", "kind", "conc", "samples", "active", *short)
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in runs:
        cells = [r.get("mode"), r.get("build"), r.get("kind"), r.get("concurrency")]
        if r.get("error"):
            out.append("| " + " | ".join(map(str, cells)) + f" | py-spy failed: {r['error']} |")
            continue
        cells += [r["samples"], r.get("active_share")]
        cells += [_pct(r["buckets"].get(b)) for b in BUCKETS]
        out.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    for r in runs:
        if r.get("error"):
            continue
        out.append(f"\n{r.get('mode')}/{r.get('build')} {r.get('kind')} c={r.get('concurrency')}"
                   f" ({r['samples']} samples)")
        own, cum = r["top_own"][:top], r["top_cumulative"][:top]
        out.append(f"  {'own':>6s}  {'function':60s} | {'cum':>6s}  function")
        for i in range(max(len(own), len(cum))):
            left = f"{_pct(own[i][1]):>6s}  {own[i][0][:60]:60s}" if i < len(own) else " " * 68
            right = f"{_pct(cum[i][1]):>6s}  {cum[i][0]}" if i < len(cum) else ""
            out.append(f"  {left} | {right}")
    return "\n".join(out)
