"""F3's microbenchmark: handing 100 tokens to main as incremental KV or as token ids."""

from __future__ import annotations

import random
import statistics

from .engine import Callback, Simulator
from .handoff import CONTROL_MESSAGE_BYTES, TOKEN_ID_BYTES
from .link import FairShareLink
from .profiles import InstanceCost, load_hardware, load_link, load_model
from .servers import DecodeServer

F1_LINE = "wan_f1"


def handoff_microbenchmark(trials: int = 200, seed: int = 3, tokens: int = 100,
                           prefix_tokens: int = 65536, background_load: float = 0.5,
                           link=None, kv_payload_bytes: float | None = None) -> dict:
    """F3: hand `tokens` tokens to main as incremental KV vs as token ids plus recompute.

    The WAN (`link`, a LinkProfile; default the F1 line) carries Poisson background flows at
    `background_load` of its rate (sizes of a low-hit suffix, exponential), and main decodes a
    background batch of 64 requests at 64K, so each trial meets a different queue, as a live
    service would.  kv_payload_bytes: the KV path's payload (default tokens x KV per token).
    """
    model = load_model("moe_1t_50kb")
    sim = Simulator(seed)
    wan = FairShareLink(sim, link or load_link(F1_LINE), "wan")
    cost = InstanceCost(load_hardware("gpu_b"), model)
    main = DecodeServer(sim, "main", 0, cost, 512, None)

    class Background:      # a stand-in job object for the background batch
        def __init__(self, i):
            self.request = type("R", (), {"request_id": -1 - i})()
    for i in range(64):
        main.start_decoding(Background(i), prefix_tokens, 10 ** 9, lambda: None)
    mean_flow = 8000 * model.kv_bytes_per_token
    flow_rate = background_load * wan.rate / mean_flow
    rng = random.Random(seed)

    def background_flow():
        wan.start_flow(rng.expovariate(1 / mean_flow), lambda: None)
        sim.schedule(rng.expovariate(flow_rate), Callback(background_flow))
    sim.schedule(0.0, Callback(background_flow))
    kv_bytes = tokens * model.kv_bytes_per_token if kv_payload_bytes is None else kv_payload_bytes
    # Scattering the received KV into main's paged pool: one read and one write of the bytes.
    copy_s = 2 * kv_bytes / (cost.hardware.hbm_bytes_per_s * cost.hardware.memory_efficiency
                             * cost.hardware.gpus_per_instance)
    kv_latencies, id_latencies = [], []

    def trial(index):
        start = sim.now
        wan.start_flow(kv_bytes, lambda: kv_latencies.append(sim.now - start + copy_s))
        delay = wan.message_delay(TOKEN_ID_BYTES * tokens + CONTROL_MESSAGE_BYTES)

        def arrive():
            main.extend(index, tokens, prefix_tokens,
                        lambda: id_latencies.append(sim.now - start))
        sim.schedule(delay, Callback(arrive))
    for i in range(trials):
        sim.at(5.0 + i * 1.0 + rng.random() * 0.5, Callback(trial, i))
    sim.run(until_s=5.0 + trials * 1.0 + 60.0)

    def stats(values, payload):
        ms = [v * 1000 for v in values]
        return {"payload_bytes": payload, "mean_ms": statistics.fmean(ms), "max_ms": max(ms),
                "std_ms": statistics.pstdev(ms), "trials": len(ms)}
    return {"kv": stats(kv_latencies, kv_bytes),
            "token_ids": stats(id_latencies, TOKEN_ID_BYTES * tokens),
            "kv_gpu_copy_ms": copy_s * 1000, "tokens": tokens}
