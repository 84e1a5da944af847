"""SGLang's own argument resolution (``prepare_server_args(...).resolve_once()``, where patch
0001 runs PDD's checks), for several command lines in one child process: importing SGLang costs
about 12 s here, so the unit tests that need it share one import. The child runs each case with
``SGLANG_HOST_IP`` unset and reports, per case, whether it resolved, the ``SGLANG_HOST_IP`` it left
and the error it raised."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

CHILD = """
import json, os, sys
from sglang.srt.server_args import prepare_server_args
for name, argv in json.loads(sys.argv[1]).items():
    os.environ.pop("SGLANG_HOST_IP", None)
    try:
        prepare_server_args(argv).resolve_once()
        outcome = {"ok": True, "host_ip": os.environ.get("SGLANG_HOST_IP"), "error": None}
    except BaseException as err:  # SGLang's parser exits; PDD's checks raise
        outcome = {"ok": False, "host_ip": None, "error": f"{type(err).__name__}: {err}"}
    print("CASE " + json.dumps({"name": name, **outcome}), flush=True)
"""


def _base(role: str) -> list[str]:
    from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model

    return ["--model-path", str(ensure_tiny_model()), "--pdd-role", role, "--device", "cpu",
            "--disaggregation-transfer-backend", "mooncake_tcp"]


def _cases() -> dict:
    return {
        "advertise_host": _base("relay") + ["--host", "0.0.0.0",
                                            "--pdd-advertise-host", "127.0.0.1"],
        "advertise_wildcard": _base("relay") + ["--host", "0.0.0.0",
                                                "--pdd-advertise-host", "0.0.0.0"],
        "tp2_kv_digest": _base("relay") + ["--tp-size", "2", "--pdd-enable-kv-digest"],
    }


@functools.lru_cache(maxsize=None)
def outcomes() -> dict:
    """name -> {"ok", "host_ip", "error"}; the child runs once per test session."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_HOST_IP"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(_cases())], capture_output=True,
                          text=True, timeout=180, env=env)
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("CASE "):
            case = json.loads(line[len("CASE "):])
            found[case.pop("name")] = case
    assert done.returncode == 0 and set(found) == set(_cases()), (done.stdout[-2000:],
                                                                  done.stderr[-3000:])
    return found
