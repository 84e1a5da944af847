#!/usr/bin/env python3
"""`make demo`: a real PD pair on this machine, showing what the decode radix cache saves.

This is the foundation-stage demo: SGLang prefill (--pdd-role prefill) and main decode
(--pdd-role main) on the tiny CPU model over Mooncake TCP. Several multi-turn conversations run
through the pair; for each turn it prints the prompt length, the decode side's cache hit, and the
KV bytes the prefill handed to Mooncake for that turn (measured at the sender), next to the bytes a
decode side without a radix cache would have needed. The three-role PDD demo over an emulated WAN
replaces it once the relay and router land (see README).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdd_sglang.testing.cluster import Cluster, SGLangServer, free_port  # noqa: E402
from pdd_sglang.testing.conversation import run_conversation, sent_for_room  # noqa: E402
from pdd_sglang.testing.tiny_model import TinyModelSpec, ensure_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-len", type=int, default=400)
    parser.add_argument("--user-len", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    spec = TinyModelSpec()
    model = ensure_tiny_model(spec)
    log_dir = Path(tempfile.mkdtemp(prefix="pdd-demo-logs-"))
    bootstrap_port = free_port()
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    servers = [
        SGLangServer("prefill", model, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            *transport)),
        SGLangServer("main", model, log_dir, extra_args=("--pdd-role", "main", *transport)),
    ]
    print(f"starting prefill and main decode on the tiny model (logs: {log_dir}) ...", flush=True)
    started = time.perf_counter()
    rows = []
    with Cluster(servers) as cluster:
        print(f"servers ready in {time.perf_counter() - started:.0f} s\n", flush=True)
        header = f"{'conv':>4} {'turn':>4} {'prompt':>7} {'hit':>6} {'sent KV B':>10} {'no-DRC B':>10} {'latency s':>9}"
        print(header)
        print("-" * len(header))
        for conv in range(args.conversations):
            turns = run_conversation(
                cluster["prefill"], cluster["main"], bootstrap_port, turns=args.turns,
                system_len=args.system_len, user_len=args.user_len,
                max_new_tokens=args.max_new_tokens, seed=conv + 1,
            )
            state = cluster["prefill"].pdd_state()
            for index, turn in enumerate(turns):
                sent = sum(row["bytes"] for row in sent_for_room(state, turn.room))
                row = {
                    "conversation": conv, "turn": index, "prompt_tokens": len(turn.prompt),
                    "cached_tokens": turn.cached_tokens, "kv_bytes_sent": sent,
                    "kv_bytes_without_drc": len(turn.prompt) * spec.kv_bytes_per_token,
                    "latency_s": round(turn.latency_s, 3),
                }
                rows.append(row)
                print(f"{conv:>4} {index:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>6} "
                      f"{sent:>10} {row['kv_bytes_without_drc']:>10} {turn.latency_s:>9.2f}",
                      flush=True)
        pools = {name: cluster[name].wait_idle() for name in ("prefill", "main")}

    sent = sum(r["kv_bytes_sent"] for r in rows)
    without = sum(r["kv_bytes_without_drc"] for r in rows)
    hit = sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)
    summary = {
        "requests": len(rows), "token_weighted_hit": round(hit, 4),
        "kv_bytes_sent": sent, "kv_bytes_without_drc": without,
        "bytes_ratio": round(sent / without, 4), "pools_after": pools, "turns": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{len(rows)} requests, token-weighted decode cache hit {hit:.1%}")
    print(f"KV bytes sent {sent:,} vs {without:,} without a decode radix cache "
          f"(ratio {sent / without:.3f})")
    leaks = {n: p for n, p in pools.items() if p["in_use_tokens"] or p["locked_tokens"]}
    print("KV slots and tree locks back to baseline" if not leaks else f"LEAK: {leaks}")
    print(f"wrote {args.out / 'demo.json'}")
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
