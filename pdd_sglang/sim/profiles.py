"""Hardware, model and link profiles (read from configs/*.toml) and the roofline cost model."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

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


@dataclass(frozen=True)
class LinkProfile:
    name: str
    source: str
    bytes_per_s: float
    rtt_s: float
    jitter_s: float
    cost_per_hour: float

    def scaled(self, factor: float) -> "LinkProfile":
        """The same line with `factor` times the bandwidth (for sweeps)."""
        return LinkProfile(self.name + f" x{factor:g}", self.source, self.bytes_per_s * factor,
                           self.rtt_s, self.jitter_s, self.cost_per_hour)


def _load(cls, kind: str, name_or_path: str | Path):
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_ROOT / kind / f"{name_or_path}.toml"
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    wanted = {f.name for f in fields(cls)}
    missing = wanted - data.keys()
    if missing:
        raise ValueError(f"{path}: missing keys {sorted(missing)}")
    return cls(**{key: data[key] for key in wanted})


def load_hardware(name: str | Path) -> HardwareProfile:
    return _load(HardwareProfile, "hardware", name)


def load_model(name: str | Path) -> ModelProfile:
    return _load(ModelProfile, "models", name)


def load_link(name: str | Path) -> LinkProfile:
    return _load(LinkProfile, "links", name)


def load_table(kind: str, name: str, table: str) -> dict:
    """An extra table of a profile file (e.g. [cluster] in hardware/cpu_demo.toml)."""
    with open(CONFIG_ROOT / kind / f"{name}.toml", "rb") as handle:
        return dict(tomllib.load(handle)[table])


class InstanceCost:
    """Roofline timing of one serving instance (hardware x model).

    A forward pass costs the larger of its memory time (weights touched + KV read, over the
    instance's HBM bandwidth) and its compute time (2 x active params per token + attention
    pairs), plus a fixed overhead.  MoE weights touched grow with the tokens in the batch until
    every expert is read, which is why decode is memory-bound and a small extend is nearly free.
    """

    def __init__(self, hardware: HardwareProfile, model: ModelProfile):
        self.hardware = hardware
        self.model = model
        gpus = hardware.gpus_per_instance
        self._memory_rate = gpus * hardware.hbm_bytes_per_s * hardware.memory_efficiency
        self._prefill_flops = gpus * hardware.peak_flops * hardware.prefill_mfu
        self._decode_flops = gpus * hardware.peak_flops * hardware.decode_mfu
        self._active_weight_bytes = model.weight_bytes * model.active_params / model.total_params
        free_bytes = gpus * hardware.hbm_bytes * hardware.usable_memory_fraction - model.weight_bytes
        if free_bytes <= 0:
            raise ValueError(f"{model.name} does not fit on {gpus} x {hardware.name}")
        self.kv_capacity_tokens = int(free_bytes // model.kv_bytes_per_token)

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """Compute-bound prefill of new_tokens after cached_tokens of reused prefix."""
        m = self.model
        flops = (2.0 * m.active_params * new_tokens
                 + m.attention_flops_per_token_pair * new_tokens * (cached_tokens + new_tokens / 2))
        memory = (min(m.weight_bytes, self._active_weight_bytes * new_tokens)
                  + (cached_tokens + new_tokens) * m.kv_bytes_per_token) / self._memory_rate
        return max(flops / self._prefill_flops, memory) + self.hardware.prefill_overhead_s

    def forward_seconds(self, decode_batch: int, decode_context_tokens: int,
                        extends=()) -> float:
        """One forward pass: a decode step of decode_batch requests (contexts summing to
        decode_context_tokens) plus any extends riding along, each (tokens, prefix_tokens)."""
        m = self.model
        extend_tokens = sum(tokens for tokens, _ in extends)
        tokens = decode_batch + extend_tokens
        if tokens == 0:
            return 0.0
        weight_bytes = min(m.weight_bytes, self._active_weight_bytes * tokens)
        read_tokens = decode_context_tokens + sum(prefix + t for t, prefix in extends)
        memory = (weight_bytes + read_tokens * m.kv_bytes_per_token) / self._memory_rate
        pairs = decode_context_tokens + sum(t * (prefix + t / 2) for t, prefix in extends)
        compute = (2.0 * m.active_params * tokens
                   + m.attention_flops_per_token_pair * pairs) / self._decode_flops
        return max(memory, compute) + self.hardware.step_overhead_s
