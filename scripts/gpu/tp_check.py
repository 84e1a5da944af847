#!/usr/bin/env python3
"""PDD at tensor parallelism >= 2 on GPUs, token-exact against plain SGLang at the same TP.

One command, on a GPU host with pdd-sglang installed (``make setup PROFILE=gpu``: our pinned SGLang
with the patch series; the lent GPU machines have torch but not our SGLang, so this script does
not run there, nor on the CPU profile, whose engine serves only the tiny model):

    python scripts/gpu/tp_check.py --model-path meta-llama/Llama-3.1-8B-Instruct --tp 2

What it does, in two phases, so it needs max(TP, P+RLD+MD TPs) GPUs, not their sum:

1. plain SGLang (no ``--pdd-role``) at ``--tp`` on GPUs ``base..``: greedy output of every prompt;
   then it stops that server;
2. P, RLD and MD (``--prefill-tp``/``--relay-tp``/``--main-tp``, each ``--tp`` by default; give
   different sizes for the heterogeneous pairs) on consecutive GPUs, behind the PDD router; every
   prompt goes through the router: short prompts take P->MD, long ones P->RLD->MD (the router's
   link is set slow, ``--wan-gbps``, so the long ones must hide the WAN behind a relay).

It prints one line per pipeline (prompts, token-identical, tokens compared), the relay's handoff
events (One-Shot, Catch-Up, handed off, finished at relay) and each server's KV pool after the run
(in use and locked must be 0), then ``PASS`` or ``FAIL``; exit status 0 only on PASS. ``--dry-run``
prints the launch lines and stops: the README's TP 2 lines come from it. Every server's log is
kept under ``--log-dir``.

Status (issues 23, 37): PDD runs at ``--tp-size`` > 1, each role at its own size where one divides
the other (SGLang's PD pairing and head slicing; the KV digest, on relay and main here, at any
size). Every combination of TP 1 and 2 is token-exact on the CPU engine
(``tests/integration/test_tp.py``, ``scripts/tp_matrix.py``); not yet run on a GPU. Sizes that do
not pair are refused by the PDD router at start, naming both. A build that still refuses TP at
start is reported as such (``REFUSED``, exit 3). The pools are checked on every TP rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SHORT_TOKENS, LONG_TOKENS = 24, 3000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp", type=int, default=2, help="plain SGLang's TP and the default for each role")
    p.add_argument("--prefill-tp", type=int)
    p.add_argument("--relay-tp", type=int)
    p.add_argument("--main-tp", type=int)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "mooncake_tcp"])
    p.add_argument("--ib-device", help="--disaggregation-ib-device for Mooncake RDMA")
    p.add_argument("--prompts", type=int, default=8, help="per pipeline")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--wan-gbps", type=float, default=0.1, help="the router's model of the link")
    p.add_argument("--log-dir", type=Path, default=Path("tp_check_logs"))
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--extra-server-args", default="", help="appended to every server's command")
    p.add_argument("--dry-run", action="store_true", help="print the launch lines and exit")
    args = p.parse_args(argv)
    for role in ("prefill", "relay", "main"):
        if getattr(args, f"{role}_tp") is None:
            setattr(args, f"{role}_tp", args.tp)
    return args


def server_cmd(args, port: int, tp: int, gpu: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
            "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp),
            "--base-gpu-id", str(gpu), *extra, *shlex.split(args.extra_server_args)]


def plan(args) -> dict:
    """Every command, with its ports and GPUs: phase 1 (plain) and phase 2 (P, RLD, MD, router)."""
    common = ["--disaggregation-transfer-backend", args.transfer_backend]
    if args.ib_device:
        common += ["--disaggregation-ib-device", args.ib_device]
    boot = free_port()
    ports = {name: free_port() for name in ("plain", "prefill", "relay", "main", "router")}
    gpu = args.base_gpu_id
    cmds = {"plain": server_cmd(args, ports["plain"], args.tp, gpu, [])}
    roles = {"prefill": ["--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(boot)],
             "relay": ["--pdd-role", "relay", "--pdd-control-port", str(free_port()),
                       "--pdd-enable-kv-digest"],
             "main": ["--pdd-role", "main", "--pdd-enable-kv-digest"]}
    for role, extra in roles.items():
        tp = getattr(args, f"{role}_tp")
        cmds[role] = server_cmd(args, ports[role], tp, gpu, [*extra, *common])
        gpu += tp
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    cmds["router"] = [sys.executable, "-m", "pdd_sglang.router", "--host", "127.0.0.1",
                      "--port", str(ports["router"]), "--prefill", url["prefill"], str(boot),
                      "--relay", url["relay"], "--main", url["main"],
                      "--wan-gbps", repr(args.wan_gbps), "--wan-rtt-ms", "0"]
    return {"cmds": cmds, "url": url, "gpus_needed": max(args.tp, gpu - args.base_gpu_id)}


class Proc:
    def __init__(self, name: str, cmd: list[str], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.name, self.log = name, log_dir / f"{name}.log"
        with open(self.log, "ab") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def tail(self, lines: int = 30) -> str:
        text = [ln for ln in self.log.read_text(errors="replace").splitlines()
                if "server_args=" not in ln]
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)  # SGLang stops its own children
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def post(url: str, body: dict, timeout: float = 600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_ready(proc: Proc, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise RuntimeError(f"{proc.name} not ready:\n{proc.tail()}")


def prompts(args) -> dict[str, list[list[int]]]:
    rng = random.Random(23)
    return {kind: [[rng.randrange(100, 20000) for _ in range(n)] for _ in range(args.prompts)]
            for kind, n in (("short", SHORT_TOKENS), ("long", LONG_TOKENS))}


def greedy(url: str, ids: list[int], args) -> dict:
    return post(url + "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}})


def report_idle(name: str, url: str, tp: int) -> bool:
    """Print the server's pool on every TP rank (and its handoff events) once its KV is free
    (30 s at most); True when no rank holds KV or radix locks."""
    def idle(pools):
        return all(p.get("in_use_tokens") == 0 and p.get("locked_tokens") == 0 for p in pools)

    for _ in range(60):  # KV frees a moment after the answer
        state = get(url + "/server_info")["internal_states"][0].get("pdd", {})
        pools = state.get("tp_ranks") or [state.get("pool", {})]
        if idle(pools):
            break
        time.sleep(0.5)
    handoff = state.get("handoff", {})
    print(f"{name:7} TP {tp}: pool in use / locked per rank "
          f"{[(p.get('in_use_tokens'), p.get('locked_tokens')) for p in pools]}"
          + (f"; handoff events {handoff.get('events')}" if handoff.get("events") else "")
          + (f"; refused {handoff.get('refused')}" if handoff.get("refused") else ""))
    return idle(pools) and not handoff.get("refused", {}).get("kv_digest_mismatch")


def run(args) -> int:
    p = plan(args)
    if args.dry_run:
        for name, cmd in p["cmds"].items():
            print(f"# {name}\n{shlex.join(cmd)}")
        print(f"# GPUs needed: {p['gpus_needed']} (phase 1 and phase 2 run one after the other)")
        return 0
    try:
        import torch

        have = torch.cuda.device_count()
    except ImportError:
        have = 0
    if have == 0:
        print("no CUDA device: skipping")
        return 0
    if have < p["gpus_needed"]:
        print(f"need {p['gpus_needed']} GPUs from --base-gpu-id {args.base_gpu_id}, see {have}")
        return 2
    work = prompts(args)
    deadline = lambda: time.monotonic() + args.ready_timeout_s  # noqa: E731
    plain = Proc("plain", p["cmds"]["plain"], args.log_dir)
    try:
        wait_ready(plain, p["url"]["plain"], deadline())
        want = {k: [greedy(p["url"]["plain"], ids, args)["output_ids"] for ids in v]
                for k, v in work.items()}
    finally:
        plain.stop()
    procs = [Proc(name, p["cmds"][name], args.log_dir) for name in ("prefill", "relay", "main")]
    try:
        for proc in procs:
            try:
                wait_ready(proc, p["url"][proc.name], deadline())
            except RuntimeError as err:
                if "PDD supports tensor parallelism 1 only" in str(err):
                    print(f"REFUSED: {proc.name}: PDD does not run at TP > 1 yet "
                          f"(plain SGLang at TP {args.tp} answered {sum(map(len, want.values()))} "
                          f"prompts); log {proc.log}")
                    return 3
                raise
        router = Proc("router", p["cmds"]["router"], args.log_dir)
        procs.append(router)
        wait_ready(router, p["url"]["router"], deadline())
        ok = True
        for kind, batch in work.items():
            seen, same = {}, 0
            for ids, expected in zip(batch, want[kind]):
                answer = greedy(p["url"]["router"], ids, args)
                pipe = answer["meta_info"].get("pdd", {}).get("pipeline", "?")
                seen[pipe] = seen.get(pipe, 0) + 1
                same += answer["output_ids"] == expected
            ok &= same == len(batch)
            print(f"{kind:5} prompts ({len(batch[0])} tokens): {same}/{len(batch)} token-identical "
                  f"to plain TP {args.tp}; pipelines {seen}")
        for name in ("prefill", "relay", "main"):
            ok &= report_idle(name, p["url"][name], getattr(args, name + "_tp"))
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(run(parse_args()))
