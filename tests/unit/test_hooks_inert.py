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
answers = {
    "begin_kv_transfer": hooks.begin_kv_transfer(1, "s", 2),
    "begin_aux_transfer": hooks.begin_aux_transfer(1, "s"),
    "record_kv_transfer_batch": hooks.record_kv_transfer_batch("s", [1, 2]),
    "add_internal_state": hooks.add_internal_state(object(), state := {}),
    "attach_route": hooks.attach_route(receiver, object()),
    "receiver_metadata": hooks.receiver_metadata(receiver, 0, [3, 4]) == (1, []),
    "receiver_concluding": hooks.receiver_concluding(receiver, status := object()) is status,
    "receiver_cleared": hooks.receiver_cleared(receiver) is None,
    "start_prefill_fanout": hooks.start_prefill_fanout(kv_mgr),
    "claim_registration": hooks.claim_registration(kv_mgr, 1, "s", []) is False,
    "claim_abort": hooks.claim_abort(kv_mgr, object()) is False,
    "take_transfer_request": hooks.take_transfer_request(kv_mgr, chunk) is False,
    "on_sender_cleared": hooks.on_sender_cleared(kv_mgr, 1),
    "engine_for_session": hooks.engine_for_session(kv_mgr, "s") is engine,
    "sliced_transfer_engine": hooks.sliced_transfer_engine(kv_mgr, "s", [8]) is engine,
    "on_prompt_kv_complete": hooks.on_prompt_kv_complete(object(), object()),
    "handoff_hold": hooks.handoff_hold(object(), reqs) is reqs,
    "handoff_step": hooks.handoff_step(object(), batch) == (batch, None),
    "handoff_idle": hooks.handoff_idle(object()) is True,
    "handoff_abort": hooks.handoff_abort(object(), object()),
    "on_scheduler_exit": hooks.on_scheduler_exit(object()),
    "wait_while_stalled": hooks.wait_while_stalled(object()),
    "before_children_start": hooks.before_children_start(),
    "after_children_started": hooks.after_children_started(),
    "add_http_routes": hooks.add_http_routes(app := SimpleNamespace()),
}
assert vars(app) == {}, app  # no route added
import signal
assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
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
