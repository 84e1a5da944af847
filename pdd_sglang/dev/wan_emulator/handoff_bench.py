"""The handoff microbenchmark over an emulated WAN line (issue 7, item 3; the report's table).

100 handed tokens crossing from the relay (cluster A) to main (cluster B), two ways:

``kv``         the tokens' incremental KV, written by a real Mooncake TCP engine in A into a
               buffer registered by main's engine in B, then the token IDs (the "written" notice).
``token_ids``  only the token IDs over the real control channel, then main's recompute: one
               EXTEND of the handed tokens over a cached prefix on a real SGLang server in B.

Latency is timed by main (B), from sending ``HandoffReady`` until the handed tokens are decoded
(kv: and the KV lies in its buffer); for ``token_ids`` SGLang's own time for the EXTEND is added.
The peers live in :mod:`pdd_sglang.dev.wan_emulator.handoff_peers`; this module starts the line, the SGLang
server and both peers, and always stops them (try/finally; the line's own cleanup besides).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import Callable, Optional

from pdd_sglang.protocol.control_channel import keygen
from pdd_sglang.dev.wan_emulator import WanLine
from pdd_sglang.dev.wan_emulator.line import stop_process
from pdd_sglang.dev.wan_emulator import handoff_peers as peers

REPO = Path(__file__).resolve().parents[3]
REALISTIC_MODEL = REPO / "configs" / "models" / "moe_1t_50kb.toml"
PEER_READY_TIMEOUT_S = 120.0
# Main's SGLang server (cluster B). Metrics on: the recompute time is SGLang's own per-request
# prefill_forward stage. Overlap scheduling off: on CPU a forward runs synchronously, so overlap
# hides nothing, and with it on a request's result is processed only after the scheduler's next
# iteration (possibly another forward), which would leak into the measured stage.
SERVER_ARGS = ("--enable-metrics", "--disable-overlap-schedule")


def realistic_kv_bytes_per_token() -> int:
    with open(REALISTIC_MODEL, "rb") as f:
        return int(tomllib.load(f)["kv_bytes_per_token"])


def summarize(values: list[float]) -> dict:
    if not values:
        return {"trials": 0}
    ordered = sorted(values)
    return {"trials": len(values), "mean_ms": statistics.fmean(values),
            "max_ms": ordered[-1], "min_ms": ordered[0],
            "p50_ms": ordered[len(ordered) // 2],
            "std_ms": statistics.stdev(values) if len(values) > 1 else 0.0}


def _read_json_line(proc: subprocess.Popen, what: str, timeout_s: float) -> dict:
    import json

    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    line = box[0] if box else ""
    if not line.startswith("{"):
        raise RuntimeError(f"the {what} did not report (exit code {proc.poll()}); see its log")
    return json.loads(line)


def run(out_dir: Path, *, trials: int = 50, warmup: int = 2, rate_mbit: float = 100.0,
        rtt_ms: float = 40.0, jitter_ms: float = 4.0, tokens: int = 100,
        prefix_tokens: int = 2048, server: bool = True,
        log: Callable[[str], None] = print) -> dict:
    """Run the benchmark; return the result dict (see :func:`build_result`)."""
    from pdd_sglang.dev.testing.tiny_model import (SPECIAL_TOKENS, VOCAB_WORDS, TinyModelSpec,
                                               ensure_tiny_model)

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec()
    vocab_size = VOCAB_WORDS + len(SPECIAL_TOKENS)
    per_token = {"realistic": realistic_kv_bytes_per_token(), "tiny_model": spec.kv_bytes_per_token}
    kv_bytes = [tokens * per_token["realistic"], tokens * per_token["tiny_model"]]
    model_path = ensure_tiny_model(spec) if server else None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    common = ["--keys", "", "--tokens", str(tokens), "--start", str(prefix_tokens),
              "--vocab-size", str(vocab_size)] + [a for n in kv_bytes for a in ("--kv-bytes", str(n))]
    main = relay = md_server = None
    load_start = os.getloadavg()
    line = WanLine(rate_mbit, rtt_ms, jitter_ms)
    logs = {name: open(out_dir / f"{name}.log", "ab") for name in ("main", "relay")}
    try:
        with tempfile.TemporaryDirectory(prefix="pdd-handoff-keys-") as keys:
            keygen(Path(keys), "relay")
            keygen(Path(keys) / "mains", "main")
            common[1] = keys
            line.start(log_path=str(out_dir / "forwarder.log"))
            log(f"line up: {rate_mbit:g} Mbit/s, RTT {rtt_ms:g} ms +-{jitter_ms:g} ms, "
                f"namespaces {line.namespaces['a']} / {line.namespaces['b']}")
            server_url = None
            if server:
                from pdd_sglang.dev.testing.wan_cluster import NetnsServer

                md_server = NetnsServer("md", model_path, out_dir, extra_args=SERVER_ARGS,
                                        exec_prefix=tuple(line.exec_prefix("b")),
                                        netns=line.namespace("b"),
                                        api_key=None)  # the peer's EXTEND posts come keyless
                log("starting the SGLang server (main, cluster B) ...")
                md_server.start()
                md_server.wait_ready(600)
                server_url = md_server.url
            main_argv = [sys.executable, "-m", "pdd_sglang.dev.wan_emulator.handoff_peers", "main",
                         "--host", line.address("b"), *common,
                         "--relay-address", f"tcp://{line.address('a')}:{peers.RELAY_CONTROL_PORT}",
                         "--netns", line.namespace("b"), "--trials", str(trials),
                         "--warmup", str(warmup), "--progress"]
            if server_url:
                main_argv += ["--server-url", server_url]
            main = line.popen("b", main_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=logs["main"], env=env, text=True)
            target = _read_json_line(main, "main peer", PEER_READY_TIMEOUT_S)
            relay = line.popen("a", [sys.executable, "-m", "pdd_sglang.dev.wan_emulator.handoff_peers", "relay",
                                     "--host", line.address("a"), *common,
                                     "--target-session", target["session_id"],
                                     "--target-ptr", str(target["buffer_ptr"])],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs["relay"],
                               env=env, text=True)
            _read_json_line(relay, "relay peer", PEER_READY_TIMEOUT_S)
            log(f"running {warmup} warm-up + {trials} trials ...")
            main.stdin.write("go\n")
            main.stdin.flush()
            main_report = _read_json_line(main, "main peer", 60.0 * (trials + warmup) + 600)
            relay.stdin.close()
            relay_report = _read_json_line(relay, "relay peer", 30.0)
            line_desc = line.describe()
    finally:
        stop_process(main)
        stop_process(relay)
        if md_server is not None:
            md_server.stop()
        line.stop()
        for f in logs.values():
            f.close()
    return build_result(main_report, relay_report, line_desc, per_token=per_token,
                        kv_bytes=kv_bytes, tokens=tokens, prefix_tokens=prefix_tokens,
                        vocab_size=vocab_size, trials=trials, warmup=warmup, server=server,
                        forwarder_stats=line.last_stats,
                        host={"cpus": os.cpu_count(), "loadavg_start": load_start,
                              "loadavg_end": os.getloadavg()})


def build_result(main_report: dict, relay_report: dict, line_desc: dict, *, per_token: dict,
                 kv_bytes: list[int], tokens: int, prefix_tokens: int, vocab_size: int,
                 trials: int, warmup: int, server: bool, forwarder_stats,
                 host: Optional[dict] = None) -> dict:
    """The JSON (``handoff.json``). ``handoff.{kv,kv_tiny_model,token_ids}`` each carry
    ``payload_bytes`` (application bytes relay -> main), ``trials``, ``mean_ms``, ``p50_ms``,
    ``max_ms``, ``min_ms``, ``std_ms`` (sample) and ``wire_bytes_mean`` (the line's kernel counters,
    both directions). ``kv`` is the 50 KB/token model, ``kv_tiny_model`` the served tiny model; both
    add ``kv_bytes``, ``kv_bytes_per_token`` and ``mooncake_write_ms`` (the relay's write alone).
    ``token_ids`` adds ``control_ms`` and ``recompute_ms`` (null without a server). ``recompute``
    holds the breakdown (extend, 1-token extend, HTTP request, decode step); ``per_trial`` the rows.
    """
    counted = [r for r in main_report["trials"] if not r["warmup"]]
    message = peers.message_bytes(tokens, vocab_size, prefix_tokens)
    transfers = [t for t in relay_report["transfers"] if t["trial"] >= warmup]
    writes = {(t["trial"], t["mode"]): t["ms"] for t in transfers}
    for row in counted:  # the relay's Mooncake write happened inside main's timed window
        if row["kv_bytes"]:
            row["mooncake_write_ms"] = writes.get((row["trial"], row["mode_index"]))

    def wire(rows):
        return statistics.fmean(r["wire_rx_bytes"] + r["wire_tx_bytes"] for r in rows)

    handoff = {}
    for mode, (name, per) in enumerate((("kv", "realistic"), ("kv_tiny_model", "tiny_model"))):
        rows = [r for r in counted if r["mode_index"] == mode]
        handoff[name] = {
            **summarize([r["ms"] for r in rows]),
            "payload_bytes": kv_bytes[mode] + message, "kv_bytes": kv_bytes[mode],
            "message_bytes": message, "kv_bytes_per_token": per_token[per],
            "wire_bytes_mean": wire(rows),
            "kv_verified": all(r["kv_verified"] for r in rows),
            "mooncake_write_ms": summarize([t["ms"] for t in transfers if t["mode"] == mode]),
        }
    rows = [r for r in counted if r["mode"] == "token_ids"]
    control = summarize([r["ms"] for r in rows])
    recompute = None
    if server:
        total = [r["ms"] + r["recompute_ms"] for r in rows]
        recompute = {
            "measured": True,
            "what": "SGLang's prefill_forward stage (sglang:per_stage_req_latency_seconds) of one "
                    f"/generate whose input_ids are a cached {prefix_tokens}-token prefix plus the "
                    f"{tokens} handed tokens, max_new_tokens=1; tiny model on CPU, torch_native",
            "device": "cpu", "prefix_tokens": prefix_tokens, "extend_tokens": tokens,
            "prefix_cached_tokens": main_report.get("prefix_cached_tokens"),
            "cached_tokens": sorted({r["cached_tokens"] for r in rows}),
            "extend_ms": summarize([r["recompute_ms"] for r in rows]),
            "extend_1_token_ms": summarize([r["extend_1_token_ms"] for r in rows]),
            "extend_request_ms": summarize([r["extend_request_ms"] for r in rows]),
            "decode_step_ms": main_report["decode_step"],
        }
    else:
        total = [r["ms"] for r in rows]
    handoff["token_ids"] = {
        **summarize(total), "payload_bytes": message, "message_bytes": message,
        "wire_bytes_mean": wire(rows), "includes_recompute": server,
        "control_ms": control,
        "recompute_ms": recompute["extend_ms"] if recompute else None,
    }
    return {
        "benchmark": "handoff", "tokens": tokens, "trials": trials, "warmup_trials": warmup,
        "line": {k: line_desc[k] for k in ("rate_mbit", "rtt_ms", "jitter_ms", "queue_bytes",
                                           "mtu", "namespaces")},
        "kv_bytes_per_token": {**per_token, "realistic_source": str(REALISTIC_MODEL.relative_to(REPO))},
        "handoff": handoff,
        "control_message_ms": control,
        "recompute": recompute or {"measured": False, "reason": "run without an SGLang server"},
        "transport": {"kv": "Mooncake TransferEngine, TCP, transfer_sync_write (relay A -> main B)",
                      "control": "pdd_sglang.protocol.control_channel ControlLoop, ZMQ ROUTER/DEALER, CURVE"},
        "refusals": {"main": main_report.get("refusals"), "relay": relay_report.get("refusals")},
        "failed_writes": sum(1 for t in relay_report["transfers"] if t["ret"] != 0),
        "forwarder": forwarder_stats,
        "host": host,
        "per_trial": counted,
    }


def format_table(result: dict) -> str:
    h = result["handoff"]
    rows = [("incremental KV (50 KB/tok)", h["kv"]), ("incremental KV (tiny model)", h["kv_tiny_model"]),
            ("token IDs + recompute" if h["token_ids"]["includes_recompute"] else "token IDs (no recompute)",
             h["token_ids"])]
    line = result["line"]
    out = [f"handoff of {result['tokens']} tokens over {line['rate_mbit']:g} Mbit/s, RTT "
           f"{line['rtt_ms']:g} ms +-{line['jitter_ms']:g} ms, {result['trials']} trials",
           f"{'path':30s} {'payload':>12s} {'mean ms':>9s} {'p50 ms':>8s} {'max ms':>9s} "
           f"{'std ms':>8s}"]
    for name, r in rows:
        out.append(f"{name:30s} {r['payload_bytes']:>10,d} B {r['mean_ms']:9.1f} {r['p50_ms']:8.1f} "
                   f"{r['max_ms']:9.1f} {r['std_ms']:8.1f}")
    c = h["token_ids"]["control_ms"]
    out.append(f"  control message round trip: mean {c['mean_ms']:.1f} ms, max {c['max_ms']:.1f} ms")
    rc = result["recompute"]
    if rc.get("measured"):
        out.append(f"  recompute ({rc['extend_tokens']}-token EXTEND, SGLang prefill_forward): "
                   f"mean {rc['extend_ms']['mean_ms']:.1f} ms; 1-token extend "
                   f"{rc['extend_1_token_ms']['mean_ms']:.1f} ms; decode step (ITL) "
                   f"{rc['decode_step_ms']['mean_ms']:.1f} ms")
    if result.get("host"):
        out.append(f"  host: {result['host']['cpus']} CPUs, load average "
                   f"{result['host']['loadavg_start'][0]:.1f} -> {result['host']['loadavg_end'][0]:.1f}")
    return "\n".join(out)
