#!/usr/bin/env python3
"""The router bench: the PDD router and sglang-router side by side on the same fake backends.

    .venv/bin/python scripts/bench_router.py                 # the issue's figures (minutes)
    .venv/bin/python scripts/bench_router.py --quick         # a smoke run (under a minute)
    .venv/bin/python scripts/bench_router.py --pdd-root-before /tmp/old-tree   # before/after
    .venv/bin/python scripts/bench_router.py --profile       # + where the PDD router's CPU goes

Writes router_bench.json (``runs``: one row per router, mode, concurrency and answer length) and
prints a table. See pdd_sglang/dev/router_bench/bench.py for what is measured and how.
With --profile, also router_profile.json beside it (py-spy samples of each PDD router during the
256-stream load run and the saturation run, in buckets: pdd_sglang/dev/router_bench/profiling.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd_sglang.dev import results as published  # noqa: E402
from pdd_sglang.dev.router_bench.bench import Settings, run_bench, table  # noqa: E402

ROUTERS = ("pdd_p_md", "pdd_p_rld_md", "sglang_router")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return values


def parse_args(argv=None) -> Settings:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small smoke settings (concurrency 1,8; 2 s runs; short answers)")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="comma-separated stream counts (default "
                        f"{','.join(map(str, d.concurrency))})")
    p.add_argument("--duration-s", type=float, default=None,
                   help=f"per run (default {d.duration_s})")
    p.add_argument("--answer-tokens", type=int, default=None, help=f"default {d.answer_tokens}")
    p.add_argument("--prompt-tokens", type=int, default=None, help=f"default {d.prompt_tokens}")
    p.add_argument("--token-rate", type=float, default=None,
                   help=f"tokens/s per stream at the fake decoders (default {d.token_rate})")
    p.add_argument("--long-answer-tokens", type=int, default=None,
                   help=f"answers after a handoff (default {d.long_answer_tokens})")
    p.add_argument("--long-token-rate", type=float, default=None,
                   help=f"their tokens/s per stream (default {d.long_token_rate})")
    p.add_argument("--long-concurrency", type=int, default=None,
                   help=f"default {d.long_concurrency}")
    p.add_argument("--handoff-tokens", type=int, default=None,
                   help=f"tokens the relay streams before its handoff (default {d.handoff_tokens})")
    p.add_argument("--ledger-rows", type=int, default=None,
                   help="transfer-ledger rows in the fake prefill's /server_info "
                        f"(default {d.ledger_rows})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs of the 256-stream load point and of saturation, medians kept "
                        f"(default {d.repeats})")
    p.add_argument("--router-cores", type=float, default=None,
                   help=f"each router's cgroup CPU quota in cores (default {d.router_cores})")
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help=f"comma-separated subset of {','.join(ROUTERS)}")
    p.add_argument("--cumulative", action="store_true",
                   help="servers and routers stream cumulative ids and text (SGLang's default) "
                        "instead of incremental chunks")
    p.add_argument("--pdd-root-before", default=None,
                   help="a copy of this repository at an older commit: its PDD router is measured "
                        "too, as build 'before'")
    p.add_argument("--no-cgroup", action="store_true",
                   help="no CPU quota (CPU time read from /proc instead)")
    p.add_argument("--profile", action="store_true",
                   help="sample each PDD router with py-spy during the 256-stream load run (the "
                        "highest concurrency when 256 is not run) and the saturation run; writes "
                        "router_profile.json beside --out")
    p.add_argument("--out", type=Path, default=Path("router_bench.json"),
                   help="the JSON file to write (a directory: router_bench.json in it)")
    p.add_argument("--log-dir", type=Path, default=Path("router_bench_logs"))
    published.add_publish_flag(p)
    a = p.parse_args(argv)
    if a.publish and a.quick:
        p.error("--publish: the current result is a full run, not --quick")
    routers = tuple(r for r in a.routers.split(",") if r)
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        p.error(f"unknown router(s) {sorted(unknown)}; choose from {','.join(ROUTERS)}")
    if a.profile and not any(r.startswith("pdd_") for r in routers):
        p.error("--profile samples the PDD router: --routers must name pdd_p_md or pdd_p_rld_md")
    if a.out.is_dir() or not a.out.suffix:  # a folder, said or meant: the runs take minutes
        a.out = a.out / "router_bench.json"
    try:
        a.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        p.error(f"--out {a.out}: {err}")
    s = Settings(routers=routers, out=a.out, log_dir=a.log_dir, cgroup=not a.no_cgroup,
                 incremental=not a.cumulative, pdd_root_before=a.pdd_root_before,
                 profile=a.profile, publish=a.publish)
    if a.quick:
        s.concurrency, s.duration_s, s.answer_tokens, s.prompt_tokens = [1, 8], 2.0, 20, 256
        s.token_rate, s.long_answer_tokens, s.long_token_rate = 100.0, 1000, 1000.0
        s.long_concurrency, s.ledger_rows, s.handoff_tokens, s.repeats = 1, 200, 8, 1
    for name in ("concurrency", "duration_s", "answer_tokens", "prompt_tokens", "token_rate",
                 "long_answer_tokens", "long_token_rate", "long_concurrency", "ledger_rows",
                 "handoff_tokens", "repeats",
                 "router_cores"):
        value = getattr(a, name)
        if value is not None:
            setattr(s, name, value)
    if s.duration_s <= 0 or s.answer_tokens < 1 or s.router_cores <= 0 or s.repeats < 1:
        p.error("--duration-s, --answer-tokens, --repeats and --router-cores must be positive")
    return s


def main(argv=None) -> int:
    settings = parse_args(argv)
    report = run_bench(settings)
    print(table(report))
    print(f"wrote {settings.out}")
    if report.get("router_profile"):
        from pdd_sglang.dev.router_bench.profiling import profile_table
        path = Path(report["router_profile"])
        print(profile_table(json.loads(path.read_text())))
        print(f"wrote {path}")
    if settings.publish:
        published.publish("router_bench", report, files={
            "router_profile.json": report["router_profile"]} if report.get("router_profile") else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
