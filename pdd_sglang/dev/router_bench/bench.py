"""The router bench: the PDD router (P->MD only; P->RLD->MD with handoffs) and ``sglang-router``
(PD mode) against the same fake backends, each router in a cgroup with the same CPU quota.

Life cycle of a bench run:

1. start the fake servers (router_bench/fake_servers.py: one process, three ports) and every
   router at once, each router in its own cgroup v1 CPU group (pdd_sglang/dev/cpu_budget.py);
   the quota applies once all answer;
2. per concurrency: the backend directly (the fake main, no router), then each router, with the
   same closed-loop load (router_bench/load.py); the router's CPU time is its group's
   ``cpuacct.usage`` over the run;
3. long answers through P->RLD->MD (a handoff, then thousands of tokens from main), a
   saturation run per router (short answers at the highest concurrency), and agentic chat
   completions (``chat``: tools, a tool call and its result in the history; router_bench/load.py)
   through each PDD router at the load point, against the direct /generate run;
4. rows into ``router_bench.json`` (``runs``: one row per router, mode, concurrency and answer
   length), a table on stdout; every process and group is removed on every exit path.

The 256-stream load point and the saturation run are measured ``repeats`` times (3), each
repetition running the backend directly and every router in turn, so all see the machine
alike; a row holds the median of each figure over its repetitions (``repeats``, and the added
P99s of each in ``per_repeat``). ``cpu_ms_per_request`` is the router's CPU time per completed
request. A PDD row also says how far off its estimated prompt tokens were (text prompts are not
tokenized by the router: ``prompt_tokens_estimate_error_p50``/``_p99``, relative to the servers'
exact count).

With ``profile`` each PDD router is sampled by py-spy during the 256-stream load run (the highest
concurrency when 256 is not run) and the saturation run, and ``router_profile.json`` is written
beside the report (router_bench/profiling.py); those rows say ``"profiled": true``.

Added TTFT and ITL are a router's percentile minus the direct one at the same concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdd_sglang.dev.router_bench.load import LoadResult, percentile, run_load
from pdd_sglang.dev.testing.cluster import free_port

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Router:
    name: str  # "pdd" or "sglang-router"
    mode: str  # "p_md", "p_rld_md", "pd"
    build: str  # "after" (this tree) or the label of --pdd-root-before
    argv: list
    env: dict
    port: int
    proc: subprocess.Popen | None = None
    cwd: str = str(REPO)  # `python -m` puts the working directory first on sys.path
    group: object = None
    log: Path | None = None
    cpu_before: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        return f"{self.name}/{self.mode}/{self.build}"


@dataclass
class Settings:
    concurrency: list = field(default_factory=lambda: [1, 64, 256, 1024])
    duration_s: float = 20.0
    answer_tokens: int = 200
    prompt_tokens: int = 2048
    token_rate: float = 50.0
    ttft_ms: float = 50.0
    prefill_ms: float = 20.0
    handoff_tokens: int = 25
    ledger_rows: int = 8192
    long_answer_tokens: int = 8192
    long_token_rate: float = 1000.0
    long_concurrency: int = 4
    sat_answer_tokens: int = 4
    repeats: int = 3  # of the 256-stream load point and the saturation run
    router_cores: float = 1.0
    incremental: bool = True
    routers: tuple = ("pdd_p_md", "pdd_p_rld_md", "sglang_router")
    pdd_root_before: str | None = None  # an older tree of this repo, measured beside this one
    out: Path = Path("router_bench.json")
    log_dir: Path = Path("router_bench_logs")
    cgroup: bool = True
    profile: bool = False  # py-spy on the PDD routers (router_bench/profiling.py)
    publish: bool = False  # also the current result in docs/results/ (dev/results.py)


def _python() -> str:
    return sys.executable


def _cpu_of(router: Router) -> float:
    """CPU seconds the router's processes used so far (its cgroup's, else /proc of its pid)."""
    if router.group is not None:
        return router.group.snapshot().cpu_s
    import psutil
    try:
        proc = psutil.Process(router.proc.pid)
        procs = [proc, *proc.children(recursive=True)]
        return sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    except psutil.Error:
        return 0.0


def _routers(s: Settings, fake: dict) -> list[Router]:
    model_env = {"PYTHONUNBUFFERED": "1"}
    inc = ["--incremental-streaming-output"] if s.incremental else []
    pdd_common = ["--prefill", fake["prefill"], "8998", "--main", fake["main"],
                  "--health-interval-s", "5", "--startup-timeout-s", "120"] + inc
    out = []
    roots = [("after", str(REPO))]
    if s.pdd_root_before:
        roots.append(("before", s.pdd_root_before))
    for build, root in roots:
        env = {**model_env, "PYTHONPATH": root}
        if "pdd_p_md" in s.routers:
            out.append(Router("pdd", "p_md", build, [_python(), "-m", "pdd_sglang.router",
                                                     *pdd_common], env, free_port(), cwd=root))
        if "pdd_p_rld_md" in s.routers:
            # A line of 1 kbit/s: every request's WAN copy is worth hiding behind the relay.
            out.append(Router("pdd", "p_rld_md", build, [
                _python(), "-m", "pdd_sglang.router", *pdd_common, "--relay", fake["relay"],
                "--wan-gbps", "0.000001"], env, free_port(), cwd=root))
    if "sglang_router" in s.routers:
        out.append(Router("sglang-router", "pd", "0.3.2", [
            _python(), "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", fake["prefill"], "8998", "--decode", fake["main"],
            "--policy", "round_robin", "--log-level", "warn",
            # Its metrics exporter binds 29000 by default: a free one, so a second bench (or
            # anything else on 29000) does not stop it at start.
            "--prometheus-port", str(free_port()),
            "--worker-startup-timeout-secs", "120"], dict(model_env), free_port()))
    return out


def _start(router: Router, s: Settings) -> None:
    argv = [*router.argv, "--host", "127.0.0.1", "--port", str(router.port)]
    prefix: tuple = ()
    if s.cgroup:
        from pdd_sglang.dev.cpu_budget import CpuGroup
        name = f"pdd-bench-{os.getpid()}-{router.name}-{router.mode}-{router.build}"
        router.group = CpuGroup(name.replace(".", "_"), s.router_cores).create()
        prefix = router.group.exec_prefix()
    router.log = s.log_dir / f"{router.name}-{router.mode}-{router.build}.log"
    env = {**os.environ, **router.env}
    with open(router.log, "wb") as log:
        router.proc = subprocess.Popen([*prefix, *argv], stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=router.cwd, start_new_session=True)


def _get(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except Exception:  # noqa: BLE001 - not up yet
        return 0


def _wait_ready(targets: list, timeout_s: float) -> None:
    """Each (url, proc or None, log): its /health answers 200 in time, or the bench stops."""
    deadline = time.monotonic() + timeout_s
    pending = list(targets)
    while pending:
        url, proc, log = pending[0]
        if proc is not None and proc.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-2000:] if log else ""
            raise RuntimeError(f"{url} exited with {proc.returncode} before it was ready:\n{tail}")
        if _get(url + "/health") == 200:
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready within {timeout_s:.0f} s (log: {log})")
        time.sleep(0.3)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _ms(value) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def _added(router_value, direct_value) -> float | None:
    if router_value is None or direct_value is None:
        return None
    return round((router_value - direct_value) * 1e3, 3)


def _row(router: Router, kind: str, concurrency: int, answer: int, res: LoadResult,
         direct: LoadResult | None, cpu_s: float) -> dict:
    p = lambda values, q: percentile(values, q)  # noqa: E731
    return {
        "router": router.name, "mode": router.mode, "build": router.build, "kind": kind,
        "concurrency": concurrency, "answer_tokens": answer,
        "added_ttft_p50_ms": _added(p(res.ttft_s, 50), direct and p(direct.ttft_s, 50)),
        "added_ttft_p99_ms": _added(p(res.ttft_s, 99), direct and p(direct.ttft_s, 99)),
        "added_itl_p50_ms": _added(p(res.itl_s, 50), direct and p(direct.itl_s, 50)),
        "added_itl_p99_ms": _added(p(res.itl_s, 99), direct and p(direct.itl_s, 99)),
        "rps": round(res.completed / res.wall_s, 2) if res.wall_s else 0.0,
        "cpu_s_per_request": round(cpu_s / res.completed, 5) if res.completed else None,
        "cpu_ms_per_request": round(cpu_s / res.completed * 1e3, 3) if res.completed else None,
        "errors": res.errors,
        "prompt_tokens_estimate_error_p50": _rounded(p(res.estimate_errors, 50)),
        "prompt_tokens_estimate_error_p99": _rounded(p(res.estimate_errors, 99)),
        "ttft_p50_ms": _ms(p(res.ttft_s, 50)), "ttft_p99_ms": _ms(p(res.ttft_s, 99)),
        "itl_p50_ms": _ms(p(res.itl_s, 50)), "itl_p99_ms": _ms(p(res.itl_s, 99)),
        "completed": res.completed, "cpu_s": round(cpu_s, 3),
        "router_cores_used": round(cpu_s / res.wall_s, 3) if res.wall_s else None,
        "error_samples": res.error_samples,
    }


def _rounded(value, digits: int = 4):
    return None if value is None else round(value, digits)


_MEDIAN_SKIP = {"router", "mode", "build", "kind", "concurrency", "answer_tokens",
                "error_samples", "profiled"}


def median_row(rows: list) -> dict:
    """One row for several repetitions of a run: the median of each figure (``errors`` and
    ``completed`` summed), ``repeats``, and each repetition's added P99s."""
    if len(rows) == 1:
        return {**rows[0], "repeats": 1}
    out = dict(rows[0])
    for key, value in rows[0].items():
        if key in _MEDIAN_SKIP or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        if key in ("errors", "completed"):
            out[key] = sum(values)
        elif values:
            out[key] = statistics.median(values)
    out["repeats"] = len(rows)
    out["per_repeat"] = {k: [r.get(k) for r in rows] for k in (
        "added_ttft_p99_ms", "added_itl_p99_ms", "rps", "cpu_ms_per_request")}
    out["error_samples"] = [e for r in rows for e in r.get("error_samples", [])][:3]
    return out


def _direct_row(kind: str, concurrency: int, answer: int, res: LoadResult) -> dict:
    p = percentile
    return {"kind": kind, "concurrency": concurrency, "answer_tokens": answer,
            "ttft_p50_ms": _ms(p(res.ttft_s, 50)), "ttft_p99_ms": _ms(p(res.ttft_s, 99)),
            "itl_p50_ms": _ms(p(res.itl_s, 50)), "itl_p99_ms": _ms(p(res.itl_s, 99)),
            "rps": round(res.completed / res.wall_s, 2) if res.wall_s else 0.0,
            "completed": res.completed, "errors": res.errors}


def _measure(router: Router | None, url: str, concurrency: int, duration_s: float,
             answer: int, s: Settings, chat: bool = False) -> tuple[LoadResult, float]:
    before = _cpu_of(router) if router is not None else 0.0
    res = asyncio.run(run_load(url, concurrency, duration_s, answer, s.prompt_tokens,
                               chat=chat))
    cpu = (_cpu_of(router) - before) if router is not None else 0.0
    return res, cpu


def _profiled(s: Settings, router: Router, kind: str, concurrency: int) -> bool:
    """The runs the profile covers: the 256-stream load run (else the highest concurrency's)
    and the saturation run, of each PDD router."""
    load_level = 256 if 256 in s.concurrency else max(s.concurrency)
    return s.profile and router.name == "pdd" and (
        kind == "saturation" or (kind == "load" and concurrency == load_level))


def _write_profile(s: Settings, entries: list) -> Path:
    from pdd_sglang.dev.router_bench import profiling
    path = s.out.with_name("router_profile.json")
    profiling.write_profile([profiling.complete(e) for e in entries], path,
                            {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()})
    return path


def _plan(s: Settings) -> list:
    """(kind, concurrency, answer tokens, repeats) of each run, in order."""
    plan = [("load", c, s.answer_tokens, s.repeats if c == 256 else 1) for c in s.concurrency]
    plan.append(("saturation", max(s.concurrency), s.sat_answer_tokens, s.repeats))
    plan.append(("long", s.long_concurrency, s.long_answer_tokens, 1))
    level = 256 if 256 in s.concurrency else max(s.concurrency)
    plan.append(("chat", level, s.answer_tokens, s.repeats if level == 256 else 1))
    return plan


def _run_router(s: Settings, router: Router, kind: str, conc: int, answer: int,
                direct: LoadResult, profiles: list | None) -> dict:
    """One run of one router; sampled by py-spy when ``profiles`` is given and it is profiled."""
    sampler = None
    if profiles is not None and _profiled(s, router, kind, conc):
        from pdd_sglang.dev.router_bench.profiling import Sampler
        sampler = Sampler(router.proc.pid, s.log_dir / (
            f"profile-{router.mode}-{router.build}-{kind}-c{conc}.txt"), s.duration_s, {
            "router": router.name, "mode": router.mode, "build": router.build,
            "kind": kind, "concurrency": conc, "answer_tokens": answer}).start()
    res, cpu = _measure(router, router.url, conc, s.duration_s, answer, s, kind == "chat")
    row = _row(router, kind, conc, answer, res, direct, cpu)
    if sampler is not None:
        row["profiled"] = True
        profiles.append(sampler.finish())
    print(f"[bench] {router.key:28s} {kind:10s} c={conc:<5d} answer={answer:<5d} "
          f"done={res.completed} errors={res.errors} cpu={cpu:.2f}s", flush=True)
    return row


def run_bench(s: Settings) -> dict:
    s.log_dir.mkdir(parents=True, exist_ok=True)
    if s.profile:
        from pdd_sglang.dev.router_bench.profiling import py_spy
        py_spy()  # refuse before anything starts when it is missing
    if "sglang_router" in s.routers and shutil.which("sglang_router") is None:
        try:
            import sglang_router  # noqa: F401
        except ImportError as err:
            raise RuntimeError("sglang-router is not installed (pip install sglang-router==0.3.2,"
                               " it is in requirements/cpu.lock)") from err
    if s.cgroup:
        from pdd_sglang.dev.cpu_budget import check_cpu_controller
        check_cpu_controller()
    from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model
    model_path = str(ensure_tiny_model())
    ports = {role: free_port() for role in ("prefill", "relay", "main")}
    fake = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    fake_argv = [_python(), "-m", "pdd_sglang.dev.router_bench.fake_servers",
                 "--prefill-port", str(ports["prefill"]), "--relay-port", str(ports["relay"]),
                 "--main-port", str(ports["main"]), "--model-path", model_path,
                 "--token-rate", str(s.token_rate), "--ttft-ms", str(s.ttft_ms),
                 "--prefill-ms", str(s.prefill_ms), "--handoff-tokens", str(s.handoff_tokens),
                 "--ledger-rows", str(s.ledger_rows),
                 "--long-answer-tokens", str(min(s.long_answer_tokens, 10**9)),
                 "--long-token-rate", str(s.long_token_rate)]
    if s.incremental:
        fake_argv.append("--incremental")
    fake_log = s.log_dir / "fake_servers.log"
    routers = _routers(s, fake)
    fake_proc = None
    runs, direct_rows, profiles = [], [], []
    try:
        with open(fake_log, "wb") as log:
            fake_proc = subprocess.Popen(fake_argv, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=str(REPO), start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(REPO)})
        _wait_ready([(fake[r], fake_proc, fake_log) for r in fake], 60)
        for router in routers:
            _start(router, s)
        _wait_ready([(r.url, r.proc, r.log) for r in routers], 180)
        for router in routers:
            if router.group is not None:
                router.group.limit()
            _measure(router, router.url, 1, 0.5, 4, s)  # warm-up: connections, first decode
        for kind, conc, answer, repeats in _plan(s):
            rows: dict = {router.key: [] for router in routers}
            for repeat in range(repeats):
                direct, _ = _measure(None, fake["main"], conc, s.duration_s, answer, s)
                direct_rows.append(_direct_row(kind, conc, answer, direct))
                print(f"[bench] direct   {kind:10s} c={conc:<5d} answer={answer:<5d} "
                      f"done={direct.completed} errors={direct.errors}", flush=True)
                for router in routers:
                    if kind == "long" and router.mode == "p_md":
                        continue  # long answers are about the handoff's splice
                    if kind == "chat" and router.name != "pdd":
                        continue  # the fake servers answer the PDD prefill's chat route only
                    row = _run_router(s, router, kind, conc, answer, direct,
                                      profiles if repeat == 0 else None)
                    rows[router.key].append(row)
            runs.extend(median_row(r) for r in rows.values() if r)
    finally:
        for router in routers:
            _stop(router.proc)
            if router.group is not None:
                with contextlib.suppress(OSError):
                    router.group.remove()
        _stop(fake_proc)
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in vars(s).items()},
              "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
              "runs": runs, "direct": direct_rows}
    if s.profile:
        report["router_profile"] = str(_write_profile(s, profiles))
    s.out.write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    head = ("router", "mode", "build", "kind", "conc", "answer", "+TTFT p50", "+TTFT p99",
            "+ITL p50", "+ITL p99", "rps", "CPU ms/req", "repeats", "errors")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def fmt(v) -> str:
        return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
    for r in report["runs"]:
        lines.append(" | ".join(fmt(v) for v in (
            r["router"], r["mode"], r["build"], r["kind"], r["concurrency"], r["answer_tokens"],
            r["added_ttft_p50_ms"], r["added_ttft_p99_ms"], r["added_itl_p50_ms"],
            r["added_itl_p99_ms"], r["rps"], r["cpu_ms_per_request"], r.get("repeats"),
            r["errors"])))
    return "\n".join(f"| {line} |" for line in lines)
