"""Every SGLang symbol that our patches hook or pdd_sglang calls still exists in the pinned release.

Checked on the source of the installed sglang with ``ast`` (no import, so no GPU is needed and
nothing heavy loads). When an upstream refactor moves one of these, this test names it before a
server fails at run time.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRT = Path(importlib.metadata.distribution("sglang").locate_file("sglang/srt"))

# (file under sglang/srt, dotted name: Class.method, Class.attr, function or module constant)
HOOKED_SYMBOLS = [
    # 0001: the flag namespace and its resolution
    ("server_args.py", "_INPUT_NAMESPACES"),
    ("arg_groups/pd_disaggregation_hook.py", "handle_pd_disaggregation"),
    ("arg_groups/arg_utils.py", "A"),
    ("arg_groups/overrides.py", "declare_resolution"),
    ("arg_groups/overrides.py", "resolving_view"),
    ("arg_groups/fields/disagg.py", "Disagg.disaggregation_mode"),
    ("arg_groups/fields/disagg.py", "Disagg.disaggregation_transfer_backend"),
    ("arg_groups/fields/disagg.py", "Disagg.disaggregation_decode_enable_radix_cache"),
    # 0002: the Mooncake sender's host-index path
    ("disaggregation/mooncake/conn.py", "MooncakeKVSender.supports_host_tensor_indices"),
    ("disaggregation/prefill.py", "SchedulerDisaggregationPrefillMixin.send_kv_chunk"),
    # 0003: the transfer ledger
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager._transfer_data"),
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.transfer_worker"),
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.send_aux"),
    ("disaggregation/mooncake/conn.py", "TransferInfo.room"),
    ("disaggregation/mooncake/conn.py", "TransferInfo.mooncake_session_id"),
    ("disaggregation/mooncake/conn.py", "TransferInfo.is_dummy"),
    # 0006: the fan-out owns PDD rooms; its senders use SGLang's send primitives
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.add_transfer_request"),
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.start_prefill_thread"),
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.send_kvcache"),
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.send_kvcache_slice"),
    ("disaggregation/mooncake/conn.py", "TransferInfo.from_zmq"),
    ("disaggregation/common/conn.py", "CommonKVManager.conclude_transfer"),
    # 0004 and pdd_sglang.diagnostics.server_info: pool and tree state
    ("managers/scheduler_components/internal_state.py",
     "SchedulerInternalStateController.get_internal_state"),
    ("mem_cache/unified_radix_cache.py", "UnifiedRadixCache.evictable_size"),
    ("mem_cache/unified_radix_cache.py", "UnifiedRadixCache.protected_size"),
    ("mem_cache/radix_cache.py", "RadixCache.evictable_size"),
    ("mem_cache/radix_cache.py", "RadixCache.protected_size"),
    ("mem_cache/allocator/token.py", "TokenToKVPoolAllocator.available_size"),
    ("mem_cache/memory_pool.py", "ReqToTokenPool.available_size"),
    # 0008 and pdd_sglang.decode: where requests move between relay and main
    ("disaggregation/decode.py", "SchedulerDisaggregationDecodeMixin.process_decode_queue"),
    ("disaggregation/decode.py",
     "SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run"),
    ("disaggregation/decode.py", "DecodeTransferQueue.pop_transferred"),
    ("disaggregation/utils.py", "prepare_abort"),
    ("managers/scheduler.py", "Scheduler.is_fully_idle"),
    ("managers/scheduler.py", "Scheduler.abort_request"),
    ("managers/io_struct.py", "BaseReq.rid"),
    ("managers/io_struct.py", "AbortReq.abort_all"),
    ("managers/schedule_batch.py", "BaseFinishReason"),
    ("managers/schedule_batch.py", "FINISH_ABORT"),
    ("managers/schedule_batch.py", "ScheduleBatch.init_new"),
    ("managers/schedule_batch.py", "ScheduleBatch.prepare_for_extend"),
    ("managers/schedule_batch.py", "ScheduleBatch.filter_batch"),
    ("managers/schedule_batch.py", "ScheduleBatch.merge_batch"),
    ("managers/schedule_batch.py", "ScheduleBatch.batch_size"),
    ("managers/schedule_batch.py", "Req.refresh_fill_ids"),
    ("managers/schedule_batch.py", "Req.finished"),
    ("managers/schedule_batch.py", "ReqKvInfo.kv_committed_len"),
    ("managers/scheduler_components/output_streamer.py", "SchedulerOutputStreamer.stream_output"),
    ("managers/scheduler_components/batch_result_processor.py",
     "SchedulerBatchResultProcessor.process_batch_result_prefill"),
    ("mem_cache/common.py", "release_kv_cache"),
    ("mem_cache/allocation.py", "alloc_for_extend"),
    # pdd_sglang.decode.handoff_grammar: main advances a held request's grammar itself
    ("constrained/base_grammar_backend.py", "BaseGrammarObject.accept_token"),
    ("constrained/base_grammar_backend.py", "BaseGrammarBackend.dispatch_regex"),
    ("constrained/xgrammar_backend.py", "XGrammarGrammar.accept_token"),
    ("constrained/xgrammar_backend.py", "XGrammarGrammar.allocate_vocab_mask"),
    ("constrained/xgrammar_backend.py", "XGrammarGrammar.fill_vocab_mask"),
    ("constrained/xgrammar_backend.py", "XGrammarGrammar.apply_vocab_mask"),
    ("constrained/xgrammar_backend.py", "XGrammarGrammarBackend"),
    ("disaggregation/decode_schedule_batch_mixin.py",
     "ScheduleBatchDisaggregationDecodeMixin.process_prebuilt"),
    ("managers/scheduler_components/batch_result_processor.py",
     "SchedulerBatchResultProcessor._apply_prefill_grammar"),
    # 0010: the scheduler process's exit path; 0011: the not-fully-idle branch of on_idle
    ("managers/scheduler.py", "run_scheduler_process"),
    ("managers/scheduler.py", "Scheduler.on_idle"),
    ("managers/scheduler_components/ipc_channels.py", "SchedulerIpcChannels.recv_from_tokenizer"),
    # 0017: the CPU engine's model-parallel groups without PyNccl
    ("distributed/parallel_state.py", "init_model_parallel_group"),
    ("distributed/parallel_state.py", "_is_cpu"),
    ("distributed/parallel_state.py", "GroupCoordinator.all_reduce"),
    # 0018: the prefill's /pdd/line on SGLang's FastAPI app, added before the server runs
    ("entrypoints/http_server.py", "app"),
    ("entrypoints/http_server.py", "launch_server"),
    ("entrypoints/http_server.py", "_setup_and_run_http_server"),
    # The prefill's /pdd/chat_request (prefill/chat_request.py) and the router's answer parsing
    # (router/chat_answer.py) call SGLang's chat serving.
    ("entrypoints/http_server.py", "validate_json_request"),
    *[("entrypoints/openai/serving_chat.py", f"OpenAIServingChat.{name}") for name in (
        "_validate_request", "_convert_to_internal_request", "_effective_tools",
        "_tool_call_parsing_active", "_get_reasoning_from_request",
        "_get_history_tool_calls_cnt", "_encoding_output", "_process_tool_calls",
        "_process_tool_call_stream", "_check_for_unstreamed_tool_args",
        "_process_reasoning_stream", "_answer_started")],
    ("entrypoints/openai/serving_chat.py", "_incomplete_tool_call_indices"),
    ("entrypoints/openai/serving_base.py", "OpenAIServingBase.create_error_response"),
    ("entrypoints/openai/protocol.py", "ChatCompletionRequest"),
    ("parser/response_template.py", "grammar_holds_calls"),
    # 0019: head-sliced KV (prefill and decode at different TP sizes) through PDD's engine choice
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager.send_kvcache_slice"),
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager._await_transfer_futures"),
    ("disaggregation/common/staging_buffer.py", "compute_head_slice_params"),
    ("disaggregation/common/conn.py", "CommonKVManager._resolve_rank_mapping"),
    # 0020: a main decodes a coded WAN copy when its receiver's poll first sees the room concluded;
    # its staging region is registered with SGLang's Mooncake engine
    ("disaggregation/common/conn.py", "CommonKVReceiver._poll"),
    ("disaggregation/common/conn.py", "CommonKVReceiver.clear"),
    ("disaggregation/common/conn.py", "CommonKVReceiver.send_metadata"),
    ("disaggregation/common/conn.py", "CommonKVManager.record_failure"),
    ("disaggregation/common/conn.py", "CommonKVManager.update_status"),
    ("distributed/device_communicators/mooncake_transfer_engine.py",
     "MooncakeTransferEngine.register"),
    ("distributed/device_communicators/mooncake_transfer_engine.py",
     "MooncakeTransferEngine.deregister"),
    ("configs/model_config.py", "ModelConfig.from_server_args"),
    # debug/0002: the debug flags' namespace; each scheduler process installs the test aids once
    # its server args are published
    ("managers/scheduler.py", "publish"),
    # Environment switches that the CPU profile and the tests set
    ("environ.py", "Envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"),
]


@lru_cache(maxsize=None)
def definitions(rel: str) -> set[str]:
    tree = ast.parse((SRT / rel).read_text())
    names: set[str] = set()

    def visit(body, prefix=""):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(prefix + node.name)
                visit(node.body, prefix + node.name + ".")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names.add(prefix + target.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(prefix + node.target.id)
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                names.update(prefix + (a.asname or a.name) for a in node.names)

    visit(tree.body)
    return names


@pytest.mark.parametrize("rel, symbol", HOOKED_SYMBOLS, ids=[s for _, s in HOOKED_SYMBOLS])
def test_hooked_symbol_exists(rel, symbol):
    assert symbol in definitions(rel), f"sglang/srt/{rel} no longer defines {symbol}"


def test_cpu_engine_switch_is_still_read():
    source = (SRT / "platforms" / "__init__.py").read_text()
    assert 'os.getenv("SGLANG_USE_CPU_ENGINE"' in source


def test_pinned_version_and_hash_agree():
    upstream = dict(
        (k.strip(), v.strip())
        for k, _, v in (
            line.partition("=") for line in (REPO / "patches" / "UPSTREAM").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        )
    )
    requirement = (REPO / "requirements" / "sglang.txt").read_text()
    assert f"sglang=={upstream['version']} --hash=sha256:{upstream['sha256']}" in requirement
    assert importlib.metadata.version("sglang") == upstream["version"]


def test_every_patch_calls_only_the_hooks_module():
    calls = set()
    for patch in (REPO / "patches").glob("*.patch"):
        calls.update(re.findall(r"^\+.*_pdd_hooks\.(\w+)\(", patch.read_text(), flags=re.M))
    hooks = ast.parse((REPO / "pdd_sglang" / "hooks.py").read_text())
    defined = {n.name for n in hooks.body if isinstance(n, ast.FunctionDef)}
    assert calls, "no patch calls pdd_sglang.hooks"
    assert calls <= defined, f"patches call undefined hooks: {calls - defined}"


def test_every_debug_patch_calls_only_the_hooks_or_the_debug_aids():
    """The debug series reaches pdd_sglang through two modules: the hooks, and the test aids
    (``pdd_sglang.dev.debug_aids``: serving code, hooks.py included, never imports dev)."""
    text = "".join(p.read_text() for p in (REPO / "patches" / "debug").glob("*.patch"))
    imports = set(re.findall(r"^\+\s*from (pdd_sglang\S*) import (\w+)", text, flags=re.M))
    assert imports <= {("pdd_sglang", "hooks"), ("pdd_sglang.dev", "debug_aids")}, imports
    for alias, module in (("_pdd_hooks", "hooks.py"),
                          ("_pdd_debug_aids", "dev/debug_aids/__init__.py")):
        calls = set(re.findall(rf"^\+.*{alias}\.(\w+)\(", text, flags=re.M))
        tree = ast.parse((REPO / "pdd_sglang" / module).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert calls and calls <= defined, f"debug patches call undefined {calls - defined}"


# Per-request state the handoff reads or sets on SGLang's Req (assigned in Req.__init__).
REQ_ATTRIBUTES = [
    "output_ids", "origin_input_ids", "full_untruncated_fill_ids", "extend_end", "prefix_len",
    "already_computed", "cached_tokens", "cached_tokens_device", "_cache_breakdown_computed",
    "send_token_offset", "inflight_middle_chunks", "finished_reason", "bootstrap_room",
    "kv_hints", "sampling_params", "return_logprob", "time_stats", "grammar",
]


@lru_cache(maxsize=None)
def init_attributes(rel: str, cls: str) -> set[str]:
    tree = ast.parse((SRT / rel).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return {t.attr for n in ast.walk(item)
                            for t in getattr(n, "targets", [getattr(n, "target", None)])
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self"}
    return set()


@pytest.mark.parametrize("attribute", REQ_ATTRIBUTES)
def test_req_attribute_the_handoff_uses_exists(attribute):
    assert attribute in init_attributes("managers/schedule_batch.py", "Req"), (
        f"sglang's Req.__init__ no longer sets {attribute}")


@pytest.mark.parametrize("attribute", ["queue"])
def test_decode_queues_the_relay_searches_exist(attribute):
    for cls in ("DecodePreallocQueue", "DecodeTransferQueue"):
        assert attribute in init_attributes("disaggregation/decode.py", cls), (cls, attribute)


# ---- the Mooncake KV manager internals the prefill fan-out and WAN path rely on ---------------
@lru_cache(maxsize=None)
def assigned_attributes(rel: str, cls: str) -> set[str]:
    """Every ``self.X`` a class assigns in any of its methods."""
    tree = ast.parse((SRT / rel).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {t.attr for n in ast.walk(node)
                    for t in getattr(n, "targets", [getattr(n, "target", None)])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id == "self"}
    return set()


MOONCAKE = "disaggregation/mooncake/conn.py"
COMMON = "disaggregation/common/conn.py"
KV_MANAGER_ATTRIBUTES = [  # read or written by pdd_sglang.prefill (fanout, senders, wan_path)
    "req_to_decode_prefix_len", "kv_args", "engine", "local_ip", "request_status",
    "decode_kv_args_table", "transfer_queues", "executors", "is_mla_backend", "attn_tp_size",
    "is_hybrid_mla_backend",
    "attn_tp_rank",  # diagnostics.line_report: only rank 0 writes the report
]
KV_MANAGER_METHODS = [
    "update_status", "send_kv_status_message", "conclude_transfer", "_registerable_regions",
    "_transfer_data", "send_kvcache", "send_kvcache_slice", "send_aux",
    "build_receiver_metadata_message", "get_session_id",
]


@pytest.mark.parametrize("attribute", KV_MANAGER_ATTRIBUTES)
def test_mooncake_kv_manager_keeps_the_state_the_fanout_uses(attribute):
    assert attribute in (assigned_attributes(MOONCAKE, "MooncakeKVManager")
                         | assigned_attributes(COMMON, "CommonKVManager")), (
        f"neither MooncakeKVManager nor CommonKVManager sets self.{attribute}")


@pytest.mark.parametrize("method", KV_MANAGER_METHODS)
def test_mooncake_kv_manager_keeps_the_methods_the_fanout_calls(method):
    assert (f"MooncakeKVManager.{method}" in definitions(MOONCAKE)
            or f"CommonKVManager.{method}" in definitions(COMMON)), method


def test_a_decode_peers_registration_has_the_fields_the_senders_read():
    """PDD's senders write with SGLang's send_kvcache / send_kvcache_slice from a peer's
    registration (``decode_kv_args_table``), as SGLang's own transfer loop does."""
    import dataclasses

    from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo

    fields = {f.name for f in dataclasses.fields(KVArgsRegisterInfo)}
    assert {"dst_kv_ptrs", "dst_aux_ptrs", "dst_tp_rank", "dst_attn_tp_size", "dst_kv_item_len",
            "dst_kv_layer_ids"} <= fields


def test_a_transfer_chunk_has_the_fields_the_per_destination_view_replaces():
    import dataclasses

    from sglang.srt.disaggregation.common.utils import TransferKVChunk

    fields = {f.name for f in dataclasses.fields(TransferKVChunk)}
    assert {"room", "prefill_kv_indices", "index_slice", "is_last_chunk", "num_kv_tokens",
            "prefill_aux_index", "state_indices", "trace_ctx", "wait_event",
            "indices_event"} <= fields


def test_the_registration_frames_keep_the_layout_the_hello_is_appended_to():
    """A decode server's registration: SGLang's frames, then PDD's hello at HELLO_FRAME_INDEX.
    SGLang's parser must still read its own fields from the first frames and ignore the extra
    one, and the hello must be where the fan-out looks for it."""
    from types import SimpleNamespace

    import numpy as np
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, TransferInfo

    from pdd_sglang.prefill.fanout import HELLO_FRAME_INDEX
    from pdd_sglang.protocol.messages import DestinationHello, decode, encode

    decode_side = SimpleNamespace(local_ip="10.0.0.2", rank_port=7001,
                                  get_session_id=lambda: "10.0.0.2:15000")
    frames = MooncakeKVManager.build_receiver_metadata_message(
        decode_side, bootstrap_room=42, required_dst_info_num=2,
        kv_indices=np.arange(4, dtype=np.int32), aux_index=3, state_indices=None,
        decode_prefix_len=16, is_dummy=False)
    assert len(frames) == HELLO_FRAME_INDEX, "SGLang's registration grew or shrank"
    hello = DestinationHello(room=42, role="main", destinations=2, prefix_tokens=16)
    info = TransferInfo.from_zmq(frames + [encode(hello)])
    assert (info.room, info.endpoint, info.dst_port, info.mooncake_session_id) == (
        42, "10.0.0.2", 7001, "10.0.0.2:15000")
    assert (info.required_dst_info_num, info.decode_prefix_len, info.is_dummy) == (2, 16, False)
    assert info.dst_kv_indices.tolist() == [0, 1, 2, 3]
    assert decode((frames + [encode(hello)])[HELLO_FRAME_INDEX], expect=DestinationHello) == hello


def test_mooncake_exposes_the_asynchronous_transfer_api_the_wan_engine_uses():
    from mooncake.engine import TransferEngine

    for name in ("transfer_submit_write", "transfer_check_status", "batch_transfer_sync_write",
                 "batch_register_memory", "batch_unregister_memory", "get_rpc_port"):
        assert hasattr(TransferEngine, name), name


# Issue 26 (operator): patch 0012's launcher, and the multiprocess metrics PDD's series join.
OPERATOR_SYMBOLS = [
    ("entrypoints/engine.py", "Engine._launch_subprocesses"),
    ("entrypoints/engine.py", "Engine._launch_detokenizer_subprocesses"),
    ("utils/common.py", "set_prometheus_multiproc_dir"),
    ("utils/common.py", "kill_itself_when_parent_died"),
    # The router's front door decides on keys with SGLang's own rules (router/front_door.py).
    ("utils/auth.py", "AuthLevel.NORMAL"),
    ("utils/auth.py", "AuthLevel.ADMIN_OPTIONAL"),
    ("utils/auth.py", "decide_request_auth"),
    ("utils/auth.py", "AuthDecision.allowed"),
    ("utils/auth.py", "AuthDecision.error_status_code"),
    # PDD's /server_info reports the model's KV bytes per token and context length from these
    # (pdd_sglang/diagnostics/server_info.py); the router places with them.
    ("configs/model_config.py", "ModelConfig.get_total_num_kv_heads"),
    ("mem_cache/allocator/base.py", "BaseTokenToKVPoolAllocator.get_kvcache"),
]


@pytest.mark.parametrize("rel, symbol", OPERATOR_SYMBOLS, ids=[s for _, s in OPERATOR_SYMBOLS])
def test_operator_symbol_exists(rel, symbol):
    assert symbol in definitions(rel), f"sglang/srt/{rel} no longer defines {symbol}"


def test_sglang_sets_the_multiprocess_metrics_dir_pdd_reads():
    source = (SRT / "utils" / "common.py").read_text()
    assert 'os.environ["PROMETHEUS_MULTIPROC_DIR"]' in source
    collector = (SRT / "observability" / "metrics_collector.py").read_text()
    assert 'name="sglang:' in collector  # the prefix PDD's series share


# Issue 23 (PDD at TP > 1): what pdd_sglang.decode.tp_sync and the fan-out's TP check rely on.
def test_the_tp_group_and_broadcast_the_handoff_step_shares_rank_0s_inputs_over():
    import inspect

    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.utils import broadcast_pyobj

    assert list(inspect.signature(broadcast_pyobj).parameters)[:4] == [
        "data", "rank", "dist_group", "src"]
    init = inspect.getsource(GroupCoordinator.__init__)
    for attribute in ("self.ranks", "self.world_size", "self.rank_in_group", "self.cpu_group",
                      "self.rank "):
        assert attribute in init, attribute
    source = (SRT / "runtime_context.py").read_text()
    assert '("tp_size", "tp_group")' in source  # get_parallel().tp_size / .tp_group
    receiver = (SRT / "managers" / "scheduler_components" / "request_receiver.py").read_text()
    assert "src=tp_group.ranks[0]" in receiver  # the call tp_sync mirrors


def test_the_handoff_step_runs_once_per_iteration_on_every_rank():
    """``RankInputs.share`` is a collective inside ``handoff_step``: SGLang's decode loops must
    call ``get_next_disagg_decode_batch_to_run`` unconditionally after ``ingest_requests``."""
    source = (SRT / "disaggregation" / "decode.py").read_text()
    for loop in ("def event_loop_normal_disagg_decode", "def event_loop_overlap_disagg_decode"):
        body = source.split(loop, 1)[1].split("\n    def ", 1)[0]
        assert body.index("self.ingest_requests()") < body.index(
            "plan = self.get_next_disagg_decode_batch_to_run("), loop
        between = body.split("self.ingest_requests()", 1)[1].split(
            "plan = self.get_next_disagg_decode_batch_to_run(", 1)[0]
        assert "continue" in between and "_engine_paused" in between  # the only skip: paused
    conn = (SRT / "disaggregation" / "common" / "conn.py").read_text()
    assert "self.attn_tp_size = parallel.attn_tp_size" in conn  # the hello's and fan-out's size


# Issue 37 (prefill, relay and main at different TP sizes): SGLang's rules PDD follows.
def test_a_decode_rank_pairs_with_prefill_ranks_by_sglangs_whole_ratios():
    """The fan-out expects ``decode TP // prefill TP`` sessions of one role per prefill rank
    (``pdd_sglang.protocol.messages.sessions_per_prefill_rank``), and refuses sizes neither of
    which divides the other: SGLang's rank mapping, which PDD does not change."""
    import inspect

    from sglang.srt.disaggregation.common.conn import CommonKVManager

    source = inspect.getsource(CommonKVManager._resolve_rank_mapping)
    assert "required_dst_info_num = self.attn_tp_size // info.attn_tp_size" in source
    assert "self.attn_tp_size // info.attn_tp_size\n" in source  # each rank's prefill rank
    assert "info.attn_tp_size // self.attn_tp_size" in source  # a decode rank's prefill ranks


def test_the_head_slices_follow_sglangs_rule_where_kv_heads_are_fewer_than_ranks():
    """``send_kvcache_slice`` (which PDD's senders call) slices by ``compute_head_slice_params``;
    its GQA replication rule is the one the KV digest counts heads by
    (``pdd_sglang.diagnostics.kv_digest.rank_heads``)."""
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

    # 2 KV heads, prefill TP 1, decode TP 4: decode ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [compute_head_slice_params(1, 4, 0, r, 2)[:3] for r in range(4)] == [
        (0, 1, 0), (0, 1, 0), (1, 1, 0), (1, 1, 0)]
    # prefill TP 2 into decode TP 1: each prefill rank writes its head at its own offset.
    assert [compute_head_slice_params(2, 1, r, 0, 2)[:3] for r in range(2)] == [
        (0, 1, 0), (0, 1, 1)]


def test_the_sliced_send_runs_each_layer_on_the_executor_it_is_given():
    """A main's sliced copy passes an executor that runs each layer on the calling sender
    thread (``pdd_sglang.prefill.tp_slices.SAME_THREAD``), so every layer's slices join
    the sender's windowed WAN copy; ``send_kvcache_slice`` must submit every layer to it and
    wait with ``_await_transfer_futures``, and 0019 must route its engine call."""
    import inspect

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    source = inspect.getsource(MooncakeKVManager.send_kvcache_slice)
    assert "executor.submit(process_layer_tp_aware" in source
    assert "return self._await_transfer_futures(futures)" in source
    assert "_pdd_hooks.sliced_transfer_engine(" in source  # patch 0019 applied


def test_a_status_message_carries_its_reason_when_the_manager_says_so():
    """The PDD prefill turns on ``kv_status_msg_carries_reason`` (off for Mooncake upstream) so a
    decode's error names why prefill failed the room; the encoder must still read that switch."""
    import inspect

    from sglang.srt.disaggregation.common.conn import CommonKVManager

    assert CommonKVManager.kv_status_msg_carries_reason is False
    assert "kv_status_msg_carries_reason" in inspect.getsource(CommonKVManager._encode_kv_status_message)


def test_the_scheduler_state_carries_its_effective_running_request_limit():
    """The router takes a server's capacity from it when --max-running-requests is unset."""
    import inspect

    from sglang.srt.managers.scheduler_components import internal_state

    assert "effective_max_running_requests_per_dp" in inspect.getsource(internal_state)


def test_sglang_aborts_every_request_whose_rid_starts_with_the_one_it_is_told():
    """Why the router ends its rids with ``attempt.RID_END``: SGLang's scheduler matches an abort
    by prefix, so a rid that is a prefix of another would abort that one too."""
    source = (SRT / "managers" / "scheduler.py").read_text()
    tree = ast.parse(source)
    abort = next(node for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef) and node.name == "abort_request")
    assert "rid.startswith(recv_req.rid)" in ast.get_source_segment(source, abort)


def _function_source(rel: str, name: str) -> str:
    source = (SRT / rel).read_text()
    node = next(node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.FunctionDef) and node.name == name)
    return ast.get_source_segment(source, node)


def test_only_sglangs_prebuilt_step_and_sampled_tokens_advance_a_decode_requests_grammar():
    """Why main advances a held request's grammar itself (``pdd_sglang.decode.handoff_grammar``):
    SGLang's PD decode accepts the prefill's first token in ``process_prebuilt``, which a held
    request skips, and an extend's result accepts only the token it sampled; a token outside
    the grammar raises ValueError, which main turns into a refusal."""
    prebuilt = _function_source("disaggregation/decode_schedule_batch_mixin.py", "process_prebuilt")
    assert "req.grammar.accept_token(req.output_ids[-1])" in prebuilt
    extend = _function_source("managers/scheduler_components/batch_result_processor.py",
                              "_apply_prefill_grammar")
    assert "req.grammar.accept_token(next_token_id)" in extend
    assert "except ValueError" in extend
    assert "raise ValueError" in _function_source("constrained/xgrammar_backend.py",
                                                  "accept_token")
