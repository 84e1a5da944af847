"""Without --pdd-role every hook returns SGLang's own answer at its first line, importing nothing."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r'''
import sys
from types import SimpleNamespace
import pdd_sglang.hooks as hooks

hooks._role = None  # what pdd_role() resolves to on a server started without --pdd-role
engine = object()
kv_mgr = SimpleNamespace(engine=engine)
receiver = SimpleNamespace(required_dst_info_num=1)
chunk, reqs, batch, queue = object(), [object()], object(), object()
info = SimpleNamespace(decode_prefix_len=16)
answers = {
    "begin_kv_transfer": hooks.begin_kv_transfer(1, "s", 2),
    "begin_aux_transfer": hooks.begin_aux_transfer(1, "s"),
    "record_kv_transfer_batch": hooks.record_kv_transfer_batch("s", [1, 2]),
    "add_internal_state": hooks.add_internal_state(object(), state := {}),
    "attach_route": hooks.attach_route(receiver, object()),
    "receiver_metadata": hooks.receiver_metadata(receiver, 0) == (1, []),
    "start_prefill_fanout": hooks.start_prefill_fanout(kv_mgr),
    "on_destination_registered": hooks.on_destination_registered(kv_mgr, 1, "s", []),
    "room_send_start": hooks.room_send_start(kv_mgr, 1, {"s": info}) == 16,
    "destinations_on_this_path": hooks.destinations_on_this_path(kv_mgr, chunk, reqs, queue) is reqs,
    "chunk_for_destination": hooks.chunk_for_destination(kv_mgr, chunk, object()) is chunk,
    "is_pdd_room": hooks.is_pdd_room(kv_mgr, 1) is False,
    "destination_sent": hooks.destination_sent(kv_mgr, object(), True),
    "destination_failed": hooks.destination_failed(kv_mgr, object()) is False,
    "engine_for_session": hooks.engine_for_session(kv_mgr, "s") is engine,
    "on_prompt_kv_complete": hooks.on_prompt_kv_complete(object(), object()),
    "handoff_hold": hooks.handoff_hold(object(), reqs) is reqs,
    "handoff_step": hooks.handoff_step(object(), batch) == (batch, None),
    "handoff_idle": hooks.handoff_idle(object()) is True,
    "handoff_abort": hooks.handoff_abort(object(), object()),
    "on_scheduler_exit": hooks.on_scheduler_exit(object()),
    "wait_while_stalled": hooks.wait_while_stalled(object()),
}
assert state == {}, state
bad = {k: v for k, v in answers.items() if v not in (None, True)}
assert not bad, bad
loaded = sorted(m for m in sys.modules if m.startswith("pdd_sglang"))
assert loaded == ["pdd_sglang", "pdd_sglang.hooks"], loaded
import threading
assert [t.name for t in threading.enumerate()] == ["MainThread"]
print("inert", len(answers))
'''


def test_every_hook_answers_as_sglang_and_loads_nothing_without_a_role():
    import ast

    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every hook the patches call is probed (a new hook must be added here too).
    hooks = ast.parse((REPO / "pdd_sglang" / "hooks.py").read_text())
    defined = {n.name for n in hooks.body if isinstance(n, ast.FunctionDef)}
    probed = set(__import__("re").findall(r'"(\w+)": hooks\.', PROBE))
    assert defined - probed == {"pdd_role", "server_arg_namespaces", "resolve_server_args"}
