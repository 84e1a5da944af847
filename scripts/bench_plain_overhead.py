#!/usr/bin/env python3
"""What the patch series costs a plain PD deployment that merely has pdd_sglang installed (issue 14).

The same plain PD workload (SGLang's own ``bench_serving``, random token ids, through a plain
prefill + decode pair without ``--pdd-role``, over Mooncake TCP) runs twice: on the patched sglang
of this venv, and on the pristine wheel. The pristine wheel is a scratch copy: ``sglang/`` hard-
linked into a temporary directory (no disk cost) and reverted there by ``apply_patches.py
--revert --site-packages`` (a revert replaces files by rename, so the shared venv's files are never
touched), then put first on the servers' ``PYTHONPATH``. On this CPU-only machine the pristine copy keeps patch 0002 (the standalone upstream fix without
which plain PD cannot run on SGLang's CPU engine; it calls no pdd_sglang code). Writes
DIR/plain_overhead.json with
``{patched_tok_s, pristine_tok_s, ratio}`` (goal: ratio >= 0.99) and prints it.

    python scripts/bench_plain_overhead.py --out out/plain_overhead
    python scripts/bench_plain_overhead.py --out DIR --num-prompts 64 --rounds 3
    python scripts/bench_plain_overhead.py --out DIR --control   # A/A: pristine against pristine

A tiny ``/generate`` proxy in this script does what SGLang's PD router does (the same body, with
the prefill's bootstrap address and a fresh room, to both servers; the decode server's answer
back), identically for both runs. Hold /tmp/pdd-servers.lock on a shared machine; the figures
are fair only on a quiet one (the script records the load average). Both pairs are started once
and stay up; the rounds alternate through them ABBA, so drift in the machine's load and the
warm-up of whichever runs first hit both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port  # noqa: E402
from pdd_sglang.dev.testing.pristine import pristine_env, pristine_sglang  # noqa: E402
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model  # noqa: E402

TRANSPORT = ("--disaggregation-transfer-backend", "mooncake_tcp")
# RELAY_CPU_ARGS: a decode server without a radix cache backs retracted requests up in a host
# pool that pins memory through CUDA by default; on the CPU engine per-request tensors instead.


class PdProxy:
    """A minimal PD front door: /generate to prefill and decode at once, decode's answer back."""

    def __init__(self, prefill: SGLangServer, decode: SGLangServer, bootstrap_port: int):
        self.prefill, self.decode, self.bootstrap_port = prefill, decode, bootstrap_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="pd-proxy")

    def __enter__(self) -> "PdProxy":
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, web

        rooms = random.Random()

        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            body.update(bootstrap_host=self.prefill.host, bootstrap_port=self.bootstrap_port,
                        bootstrap_room=rooms.randrange(1, 2**62))
            async with ClientSession(timeout=ClientTimeout(total=600)) as session:
                prefill = asyncio.ensure_future(session.post(self.prefill.url + "/generate", json=body))
                async with session.post(self.decode.url + "/generate", json=body) as answer:
                    out = web.StreamResponse(status=answer.status,
                                             headers={"Content-Type": answer.content_type})
                    await out.prepare(request)
                    async for chunk in answer.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                (await prefill).release()
                return out

        async def passthrough(request: web.Request) -> web.Response:
            async with ClientSession() as session:
                async with session.get(self.decode.url + request.path) as answer:
                    return web.Response(body=await answer.read(), status=answer.status,
                                        content_type=answer.content_type)

        async def flush_cache(request: web.Request) -> web.Response:
            async with ClientSession() as session:
                for server in (self.prefill, self.decode):
                    async with session.post(server.url + "/flush_cache",
                                            params=request.query) as answer:
                        if answer.status != 200:
                            return web.Response(status=answer.status, body=await answer.read())
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/flush_cache", flush_cache)
        for path in ("/get_model_info", "/model_info", "/server_info", "/v1/models", "/health"):
            app.router.add_get(path, passthrough)
        runner = web.AppRunner(app)
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())


@contextmanager
def plain_pair(label: str, out: Path, model: Path, env: dict):
    """A plain prefill + decode pair (no ``--pdd-role``) behind the PD proxy, started once."""
    log_dir = out / label
    bootstrap_port = free_port()
    # Open servers (no --api-key), as the plain PD proxy below calls them.
    prefill = SGLangServer(f"{label}-prefill", model, log_dir, env=dict(env), api_key=None,
                           extra_args=(
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
        *TRANSPORT))
    decode = SGLangServer(f"{label}-decode", model, log_dir, env=dict(env), api_key=None,
                          extra_args=(
        "--disaggregation-mode", "decode", *TRANSPORT, *RELAY_CPU_ARGS))
    with Cluster([prefill, decode]), PdProxy(prefill, decode, bootstrap_port) as proxy:
        proxy.log_dir = log_dir
        yield proxy


def run_workload(label: str, index: int, proxy: "PdProxy", model: Path, args) -> dict:
    """One ``bench_serving`` run through a pair's proxy."""
    result_file = proxy.log_dir / f"bench-{index}.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", proxy.url, "--dataset-name", "random-ids",
           "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
           "--max-concurrency", str(args.concurrency), "--seed", str(1 + index),
           "--tokenizer", str(model), "--model", str(model), "--output-file", str(result_file),
           "--disable-tqdm", "--warmup-requests", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving failed ({label}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    record = json.loads(result_file.read_text().splitlines()[-1])
    if record.get("completed") != args.num_prompts:
        raise RuntimeError(f"{label}: {record.get('completed')} of {args.num_prompts} completed")
    return {"output_tok_s": record["output_throughput"],
            "total_tok_s": record.get("total_throughput"), "completed": record["completed"]}


def abba(rounds: int, first: str = "patched", second: str = "pristine") -> list[tuple[str, str]]:
    """Round i runs ``first`` then ``second``, round i+1 the other way (ABBA): a drift in the
    machine's load, or a warm-up effect of whichever runs first, falls on both alike."""
    return [(first, second) if i % 2 == 0 else (second, first) for i in range(rounds)]


def guard_cost_ns(calls: int = 200_000) -> dict:
    """What every hook pays on a server without a role before it returns SGLang's own answer:
    the call and its first line, ``pdd_role()``. Timed in this process, both before the role is
    resolved (no server args published: a lookup that fails each time) and after (cached None)."""
    import timeit

    from pdd_sglang import hooks

    saved = hooks._role
    try:
        hooks._role = hooks._UNRESOLVED
        hooks.pdd_role()  # the first call imports SGLang's runtime context
        unresolved = timeit.timeit(hooks.pdd_role, number=calls // 10) / (calls // 10)
        hooks._role = None
        # handoff_idle: the hook called on every pass of the scheduler's loop
        resolved = timeit.timeit(lambda: hooks.handoff_idle(None), number=calls) / calls
    finally:
        hooks._role = saved
    return {"hook_call_role_none_ns": round(resolved * 1e9, 1),
            "pdd_role_unresolved_ns": round(unresolved * 1e9, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4,
                        help="patched/pristine pairs, alternated ABBA")
    parser.add_argument("--control", action="store_true",
                        help="an A/A run: two pristine pairs in the patched pair's place and the "
                             "pristine one's, to measure what the bench itself tells apart")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model()
    first, second = ("pristine_a", "pristine_b") if args.control else ("patched", "pristine")
    runs: dict = {first: [], second: []}
    load_before = os.getloadavg()[0]
    # Both pairs stay up for the whole run and take turns (an idle SGLang server sleeps: about
    # 0.01 core), so every round compares the same four processes, not fresh starts.
    with pristine_sglang(with_cpu_fix=True) as scratch:
        first_env = pristine_env(scratch) if args.control else {}
        with plain_pair(first, args.out, model, first_env) as first_proxy, \
                plain_pair(second, args.out, model, pristine_env(scratch)) as second_proxy:
            proxies = {first: first_proxy, second: second_proxy}
            for index, order in enumerate(abba(args.rounds, first, second)):
                for label in order:
                    print(f"round {index + 1}: {label} ...", file=sys.stderr, flush=True)
                    runs[label].append(run_workload(label, index, proxies[label], model, args))
    patched = statistics.fmean(r["output_tok_s"] for r in runs[first])
    pristine = statistics.fmean(r["output_tok_s"] for r in runs[second])
    per_round = [round(p["output_tok_s"] / q["output_tok_s"], 3)
                 for p, q in zip(runs[first], runs[second])]
    result = {"patched_tok_s": patched, "pristine_tok_s": pristine, "ratio": patched / pristine,
              "goal_ratio": 0.99, "ratio_per_round": per_round,
              "control": args.control,
              "pairs": {"patched_tok_s": first, "pristine_tok_s": second},
              "workload": {k: getattr(args, k) for k in (
                  "num_prompts", "input_len", "output_len", "concurrency", "rounds")},
              "design": "both pairs up throughout; rounds alternate ABBA through the same servers",
              "guard": guard_cost_ns(),
              "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
              "runs": runs}
    path = args.out / "plain_overhead.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    print(f"{first} {patched:.1f} tok/s, {second} {pristine:.1f} tok/s, ratio {patched / pristine:.3f}"
          f"{' (A/A control: no patch between them)' if args.control else ' (goal >= 0.99)'}; "
          f"per round {per_round}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
