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
    # 0006's failed-destination hook: SGLang's dead-session bookkeeping it sits beside
    ("disaggregation/mooncake/conn.py", "MooncakeKVManager._poison_unsettled_send"),
    ("disaggregation/common/conn.py", "CommonKVManager.conclude_failure"),
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


# Per-request state the handoff reads or sets on SGLang's Req (assigned in Req.__init__).
REQ_ATTRIBUTES = [
    "output_ids", "origin_input_ids", "full_untruncated_fill_ids", "extend_end", "prefix_len",
    "already_computed", "cached_tokens", "cached_tokens_device", "_cache_breakdown_computed",
    "send_token_offset", "inflight_middle_chunks", "finished_reason", "bootstrap_room",
    "kv_hints", "sampling_params", "return_logprob", "time_stats",
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
