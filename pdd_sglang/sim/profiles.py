"""Hardware, model and link profiles (read from configs/*.toml) and the roofline cost model."""

from __future__ import annotations

import math
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from ..policy.wan_codec import CodecCost

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str
    gpus_per_instance: int
    peak_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    prefill_mfu: float
    decode_mfu: float
    memory_efficiency: float
    usable_memory_fraction: float
    step_overhead_s: float
    prefill_overhead_s: float
    cost_per_gpu_hour: float
    # GPUs one request's attention is split over (its tensor-parallel width). 1 under DP
    # attention, SGLang's deployment of MLA models with expert parallelism: each GPU runs the
    # attention of its own requests, the MoE layers are shared by all GPUs of the instance.
    attention_parallel_gpus: int = 0        # 0: the whole instance (plain tensor parallelism)
    # Latency every request pays before prefill that occupies no instance: HTTP hops, the PD
    # bootstrap handshake, tokenizing, scheduler polling.
    dispatch_latency_s: float = 0.0
    # Efficiency of prefill attention (FlashAttention-class kernels); 0: prefill_mfu, which
    # then covers the linear/MoE layers only.
    attention_mfu: float = 0.0
    # Prefill runs in chunks of this many new tokens (SGLang's --chunked-prefill-size); each
    # chunk is one forward pass and pays prefill_overhead_s.  0: the whole prompt in one pass.
    chunked_prefill_tokens: int = 0
    # Expert-parallel dispatch + combine latency per MoE layer of a decode step at this
    # instance's EP width.  Overlapped with compute (two-batch overlap), so a step lasts at least
    # moe_layers x this; it is what keeps a lightly loaded decoder from running faster.
    ep_layer_latency_s: float = 0.0
    # Measured instead of modelled (scripts/profile_cpu.py, scripts/gpu/profile_gpu.py): when
    # prefill_s_per_token > 0, a forward that prefills B requests of N new tokens after C cached
    # ones lasts prefill_fixed_s + prefill_s_per_token x N + prefill_s_per_token_pair x
    # N (C + N/2) + prefill_s_per_cached_token x C (summed over the requests); when a
    # decode_* field is > 0, a decode step of B requests over L context tokens in all lasts
    # decode_fixed_s + decode_s_per_request x B + decode_s_per_context_token x L.  The
    # roofline fields are then unused for that phase.
    prefill_fixed_s: float = 0.0
    prefill_s_per_token: float = 0.0
    prefill_s_per_token_pair: float = 0.0
    prefill_s_per_cached_token: float = 0.0    # reading the cached prefix, per request
    decode_fixed_s: float = 0.0
    decode_s_per_request: float = 0.0
    decode_s_per_context_token: float = 0.0
    # Servers sharing one machine (the CPU demo, with ClusterConfig.shared_host): a forward
    # runs this much longer per other busy server (measured by profile_cpu.py).
    neighbour_slowdown: float = 0.0

    def __post_init__(self):
        for key in ("prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token_pair",
                    "prefill_s_per_cached_token", "neighbour_slowdown", "decode_fixed_s",
                    "decode_s_per_request", "decode_s_per_context_token"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"hardware {self.name!r}: {key} must be >= 0")
        for key in ("peak_flops", "hbm_bytes_per_s", "prefill_mfu", "decode_mfu",
                    "memory_efficiency"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware {self.name!r}: {key} must be > 0")
        for key in ("prefill_mfu", "decode_mfu", "attention_mfu", "memory_efficiency"):
            if getattr(self, key) > 1:
                raise ValueError(f"hardware {self.name!r}: {key} is a fraction of peak, got "
                                 f"{getattr(self, key)}")

    @property
    def prefill_attention_mfu(self) -> float:
        return self.attention_mfu or self.prefill_mfu

    @property
    def attention_gpus(self) -> int:
        return self.attention_parallel_gpus or self.gpus_per_instance

    @property
    def prefill_lanes(self) -> int:
        """Requests an instance prefills at once: one per attention group (DP rank)."""
        return max(1, self.gpus_per_instance // self.attention_gpus)

    @property
    def cost_per_instance_hour(self) -> float:
        return self.cost_per_gpu_hour * self.gpus_per_instance


@dataclass(frozen=True)
class ModelProfile:
    name: str
    source: str
    total_params: float
    active_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    attention_flops_per_token_pair: float
    # Decode may use another attention form (MLA's weight-absorbed path); 0: same as prefill.
    decode_attention_flops_per_token_pair: float = 0.0
    moe_layers: int = 0          # layers whose experts are spread over the instance (EP)

    @property
    def decode_pair_flops(self) -> float:
        return self.decode_attention_flops_per_token_pair or self.attention_flops_per_token_pair


@dataclass(frozen=True)
class LinkProfile:
    name: str
    source: str
    bytes_per_s: float
    rtt_s: float
    jitter_s: float
    cost_per_hour: float
    # One flow's window: a flow never moves more than window_bytes per RTT (TCP's window / RTT,
    # or the transfer engine's in-flight limit), however idle the line.  0: no per-flow limit.
    window_bytes: float = 0.0
    # Paid once per transfer after its last byte is sent, occupying no bandwidth: connection or
    # session setup, handshake, completion notice and polling at the receiver.
    per_transfer_fixed_s: float = 0.0
    # Bytes the line carries (both directions) per payload byte a flow delivers: packet
    # headers, retransmissions of dropped packets, the receiver's ACKs.  1: payload only.
    wire_per_payload_byte: float = 1.0
    # How concurrent copies share the line: "fair" (each active copy gets an equal share) or
    # "in_order" (a copy waits for the bytes of those started before it).
    copy_order: str = "fair"

    def __post_init__(self):
        if self.copy_order not in ("fair", "in_order"):
            raise ValueError(f"link {self.name!r}: copy_order must be 'fair' or 'in_order', "
                             f"got {self.copy_order!r}")
        if not self.wire_per_payload_byte >= 1:
            raise ValueError(f"link {self.name!r}: wire_per_payload_byte must be >= 1")
        for key in ("bytes_per_s", "rtt_s", "jitter_s", "window_bytes", "per_transfer_fixed_s"):
            value = getattr(self, key)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"link {self.name!r}: {key} must be finite and >= 0, got {value!r}")
        if self.window_bytes and not self.rtt_s:
            raise ValueError(f"link {self.name!r}: a window needs a positive rtt_s")

    @property
    def per_flow_bytes_per_s(self) -> float:
        """The most one flow can move: window / RTT (infinite without a window)."""
        return self.window_bytes / self.rtt_s if self.window_bytes else math.inf

    def scaled(self, factor: float) -> "LinkProfile":
        """The same line with `factor` times the bandwidth (for sweeps); the per-flow window is
        a property of the endpoints and stays."""
        return replace(self, name=self.name + f" x{factor:g}", bytes_per_s=self.bytes_per_s * factor)

    def with_window(self, window_bytes: float) -> "LinkProfile":
        return replace(self, name=self.name + f" window {window_bytes / 1e6:g} MB",
                       window_bytes=window_bytes)


@dataclass(frozen=True)
class CodecProfile:
    """What a KV codec does to main-bound WAN copies (issue 36): configs/codecs/*.toml, each
    figure measured (scripts/bench_wan_codec.py) or taken from a named source.

    ratio: raw KV bytes per wire byte; encode_bytes_per_s / decode_bytes_per_s: raw bytes per
    second one copy is coded at the prefill and restored at main (inf: a codec that never paces
    a copy); lossless: auto may choose it (the sim codes a copy only where that is shorter:
    ``policy.wan_codec.choose_wan_codec``); a lossy codec (``fp8``) codes every copy, as forced.
    The simulator does not model a lossy codec's effect on the tokens.
    """

    name: str
    source: str
    codec: str
    ratio: float
    encode_bytes_per_s: float
    decode_bytes_per_s: float
    lossless: bool

    def __post_init__(self):
        self.cost  # validates the ratio and the rates

    @property
    def cost(self) -> CodecCost:
        return CodecCost(self.codec, self.ratio, self.encode_bytes_per_s,
                         self.decode_bytes_per_s, self.lossless)


def _load(cls, kind: str, name_or_path: str | Path):
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_ROOT / kind / f"{name_or_path}.toml"
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    wanted = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING}
    missing = required - data.keys()
    if missing:
        raise ValueError(f"{path}: missing keys {sorted(missing)}")
    return cls(**{key: data[key] for key in wanted if key in data})


def load_hardware(name: str | Path) -> HardwareProfile:
    return _load(HardwareProfile, "hardware", name)


def load_model(name: str | Path) -> ModelProfile:
    return _load(ModelProfile, "models", name)


def load_link(name: str | Path) -> LinkProfile:
    return _load(LinkProfile, "links", name)


def load_codec(name: str | Path) -> CodecProfile:
    return _load(CodecProfile, "codecs", name)


def load_table(kind: str, name: str, table: str) -> dict:
    """An extra table of a profile file (e.g. [cluster] in hardware/cpu_demo.toml)."""
    with open(CONFIG_ROOT / kind / f"{name}.toml", "rb") as handle:
        return dict(tomllib.load(handle)[table])


class InstanceCost:
    """Roofline timing of one serving instance (hardware x model).

    Prefill: a request's attention (FLOPs per (query, context) token pair, so it grows with the
    cached context it attends over) runs on its attention group of `attention_gpus` GPUs; its
    linear layers (2 x active params per token, MoE experts spread over every GPU of the
    instance) run on the whole instance, shared with the other requests being prefilled at the
    same time.  With one request in flight this is the request's latency on an idle instance;
    with every lane busy each lane gets 1/lanes of the instance, so throughput is exact.

    Decode: a forward pass costs the larger of its memory time (weights touched + KV read, over
    the instance's HBM bandwidth), its compute time and its expert-parallel communication
    (moe_layers x ep_layer_latency_s, overlapped with the other two), plus a fixed overhead.  MoE weights
    touched grow with the tokens in the batch until every expert is read, which is why decode
    is memory-bound and a small extend is nearly free.
    """

    def __init__(self, hardware: HardwareProfile, model: ModelProfile):
        self.hardware = hardware
        self.model = model
        gpus = hardware.gpus_per_instance
        self.prefill_lanes = hardware.prefill_lanes
        self._memory_rate = gpus * hardware.hbm_bytes_per_s * hardware.memory_efficiency
        self._lane_memory_rate = (hardware.attention_gpus * hardware.hbm_bytes_per_s
                                  * hardware.memory_efficiency)
        self._prefill_flops = gpus * hardware.peak_flops * hardware.prefill_mfu
        self._decode_flops = gpus * hardware.peak_flops * hardware.decode_mfu
        self._lane_attention_flops = (hardware.attention_gpus * hardware.peak_flops
                                      * hardware.prefill_attention_mfu)
        self._ep_step_s = model.moe_layers * hardware.ep_layer_latency_s
        self._active_weight_bytes = model.weight_bytes * model.active_params / model.total_params
        free_bytes = gpus * hardware.hbm_bytes * hardware.usable_memory_fraction - model.weight_bytes
        if free_bytes <= 0:
            raise ValueError(f"{model.name} does not fit on {gpus} x {hardware.name}")
        self.kv_capacity_tokens = int(free_bytes // model.kv_bytes_per_token)

    def prefill_seconds(self, new_tokens: int, cached_tokens: int, concurrent: int = 1) -> float:
        """Compute-bound prefill of new_tokens after cached_tokens of reused prefix, while
        `concurrent` requests (this one included) share the instance's linear layers.

        Attention (FLOPs per (query, context) pair) runs on the request's attention group at
        attention_mfu; the linear/MoE layers (2 x active params per token) on the whole instance
        at prefill_mfu; writing the new tokens' KV is a memory pass; each chunk of
        chunked_prefill_tokens is one forward pass paying prefill_overhead_s.  Chunking leaves
        the attention pairs unchanged: chunk i attends over the cache and the chunks before it.
        """
        m = self.model
        hardware = self.hardware
        if hardware.prefill_s_per_token > 0:
            return (self.measured_extend_seconds(new_tokens, cached_tokens)
                    + hardware.prefill_fixed_s)
        share = min(max(concurrent, 1), self.prefill_lanes)
        attention = max(
            m.attention_flops_per_token_pair * new_tokens * (cached_tokens + new_tokens / 2)
            / self._lane_attention_flops,
            (cached_tokens + new_tokens) * m.kv_bytes_per_token / self._lane_memory_rate)
        kv_write = new_tokens * m.kv_bytes_per_token / self._lane_memory_rate
        linear = share * max(2.0 * m.active_params * new_tokens / self._prefill_flops,
                             min(m.weight_bytes, self._active_weight_bytes * new_tokens)
                             / self._memory_rate)
        chunk = hardware.chunked_prefill_tokens or max(new_tokens, 1)
        forwards = max(1, math.ceil(new_tokens / chunk))
        return attention + kv_write + linear + forwards * hardware.prefill_overhead_s

    def measured_extend_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """The measured per-token part of prefilling new_tokens after cached_tokens (no fixed
        cost): 0 without measured prefill coefficients."""
        hardware = self.hardware
        return (hardware.prefill_s_per_token * new_tokens + hardware.prefill_s_per_token_pair
                * new_tokens * (cached_tokens + new_tokens / 2)
                + hardware.prefill_s_per_cached_token * cached_tokens)

    def forward_seconds(self, decode_batch: int, decode_context_tokens: int,
                        extends=()) -> float:
        """One forward pass: a decode step of decode_batch requests (contexts summing to
        decode_context_tokens) plus any extends riding along, each (tokens, prefix_tokens)."""
        m = self.model
        extend_tokens = sum(tokens for tokens, _ in extends)
        tokens = decode_batch + extend_tokens
        if tokens == 0:
            return 0.0
        hardware = self.hardware
        if (hardware.decode_fixed_s + hardware.decode_s_per_request
                + hardware.decode_s_per_context_token) > 0:
            extend_s = sum(self.measured_extend_seconds(t, prefix) for t, prefix in extends)
            return (hardware.decode_fixed_s + hardware.decode_s_per_request * decode_batch
                    + hardware.decode_s_per_context_token * decode_context_tokens + extend_s)
        weight_bytes = min(m.weight_bytes, self._active_weight_bytes * tokens)
        read_tokens = decode_context_tokens + sum(prefix + t for t, prefix in extends)
        memory = (weight_bytes + read_tokens * m.kv_bytes_per_token) / self._memory_rate
        pairs = decode_context_tokens + sum(t * (prefix + t / 2) for t, prefix in extends)
        compute = (2.0 * m.active_params * tokens
                   + m.decode_pair_flops * pairs) / self._decode_flops
        return max(memory, compute, self._ep_step_s) + self.hardware.step_overhead_s
