"""Serving instances: a FIFO prefill server and a continuously batching decode server."""

from __future__ import annotations

import heapq
from collections import deque

from ..policy import MainCandidate, RelayLoad
from .cache import BlockPrefixCache
from .engine import Event, Simulator
from .profiles import InstanceCost

RECENT_COPIES = 8           # copies a main's measured WAN throughput is taken over
ITL_BIN_S = 0.0005          # inter-token latency histogram resolution


class Host:
    """Servers sharing one machine's cores (the CPU demo): a forward that starts while others
    are busy runs 1 + neighbour_slowdown x (busy others) times its measured length."""

    def __init__(self):
        self.busy: set = set()

    def stretch(self, server, seconds: float) -> float:
        self.busy.add(server)
        others = len(self.busy) - 1
        return seconds * (1.0 + server.cost.hardware.neighbour_slowdown * others)

    def idle(self, server) -> None:
        self.busy.discard(server)


class PrefillDone(Event):
    __slots__ = ("server", "job", "lane")

    def __init__(self, server, job, lane):
        self.server = server
        self.job = job
        self.lane = lane

    def fire(self, sim):
        self.server._finish(self.job, self.lane)


class PrefillServer:
    """A prefill instance with `cost.prefill_lanes` attention groups (DP ranks): each prefills
    one request at a time, FIFO across the instance; the linear (MoE) layers are shared by the
    requests in flight (InstanceCost.prefill_seconds).  The prefix cache decides how many
    tokens are new.  A lane's GPU also owns the NIC its request's KV leaves by."""

    QUEUE_NORMALISER = 8     # queued requests beyond the lanes that count as "fully loaded"
    MAX_PREFILL_TOKENS = 16384   # SGLang's --max-prefill-tokens default: one batch's new tokens

    def __init__(self, sim: Simulator, index: int, cost: InstanceCost,
                 cache: BlockPrefixCache, on_done):
        self.sim = sim
        self.index = index
        self.cost = cost
        self.cache = cache
        self.on_done = on_done
        self.queue: deque = deque()
        self.lanes = cost.prefill_lanes
        self.free_lanes = list(range(self.lanes))     # a heap: the lowest free lane first
        self.busy_seconds = 0.0                       # lane-seconds
        self.max_waiting = 0
        self.host: Host | None = None

    @property
    def busy(self) -> int:
        return self.lanes - len(self.free_lanes)

    def candidate(self, request) -> MainCandidate:
        cached = self.cache.cached_tokens(request.prompt_blocks, request.input_tokens)
        return MainCandidate(cached, len(self.queue) + self.busy,
                             self.lanes + self.QUEUE_NORMALISER)

    def submit(self, job) -> None:
        self.queue.append(job)
        self.max_waiting = max(self.max_waiting, len(self.queue))
        self._start_next()

    def _start_next(self) -> None:
        if self.cost.hardware.prefill_s_per_token > 0:     # measured profile: SGLang's batches
            self._start_batch()
            return
        while self.queue and self.free_lanes:
            lane = heapq.heappop(self.free_lanes)
            job = self.queue.popleft()
            job.prefill_index = self.index
            job.prefill_lane = lane
            request = job.request
            cached = self.cache.cached_tokens(request.prompt_blocks, request.input_tokens,
                                              touch=True)
            job.prefill_cached_tokens = cached
            job.prefill_start_s = self.sim.now
            duration = self.cost.prefill_seconds(request.input_tokens - cached, cached,
                                                 concurrent=self.busy)
            self.busy_seconds += duration
            self.sim.schedule(duration, PrefillDone(self, job, lane))

    def _start_batch(self) -> None:
        """One forward prefills every waiting request (up to MAX_PREFILL_TOKENS new tokens), as
        SGLang's scheduler batches the waiting queue between forwards; a request arriving during
        a forward waits for it to end.  Every request of the batch finishes with the forward."""
        if not self.queue or not self.free_lanes:
            return
        lane = heapq.heappop(self.free_lanes)
        batch, new_total, duration = [], 0, self.cost.hardware.prefill_fixed_s
        while self.queue and (not batch or new_total < self.MAX_PREFILL_TOKENS):
            job = self.queue.popleft()
            request = job.request
            cached = self.cache.cached_tokens(request.prompt_blocks, request.input_tokens,
                                              touch=True)
            job.prefill_index, job.prefill_lane = self.index, lane
            job.prefill_cached_tokens = cached
            job.prefill_start_s = self.sim.now
            new_total += request.input_tokens - cached
            duration += self.cost.measured_extend_seconds(request.input_tokens - cached, cached)
            batch.append(job)
        if self.host is not None:
            duration = self.host.stretch(self, duration)
        self.busy_seconds += duration
        self.sim.schedule(duration, PrefillBatchDone(self, batch, lane))

    def _finish_batch(self, batch, lane) -> None:
        for job in batch:
            self.cache.insert(job.request.prompt_blocks)
            job.prefill_done_s = self.sim.now
        heapq.heappush(self.free_lanes, lane)
        if self.host is not None:
            self.host.idle(self)
        for job in batch:
            self.on_done(job)
        self._start_next()

    def _finish(self, job, lane) -> None:
        self.cache.insert(job.request.prompt_blocks)
        job.prefill_done_s = self.sim.now
        heapq.heappush(self.free_lanes, lane)
        self.on_done(job)
        self._start_next()


class PrefillBatchDone(Event):
    __slots__ = ("server", "batch", "lane")

    def __init__(self, server, batch, lane):
        self.server = server
        self.batch = batch
        self.lane = lane

    def fire(self, sim):
        self.server._finish_batch(self.batch, self.lane)


class DecodeStepDone(Event):
    __slots__ = ("server",)

    def __init__(self, server):
        self.server = server

    def fire(self, sim):
        self.server._step_done()


class DecodeServer:
    """Continuous batching: every running request gets one token per step; a step's time comes
    from the roofline model of the whole batch, plus any handoff extends riding in it.

    A request first reserves KV (a slot and its tokens; it may wait in an admission queue), then
    joins the batch at the next step boundary.  Its tokens are counted from step numbers, so the
    per-step work does not grow with the batch.
    """

    def __init__(self, sim: Simulator, role: str, index: int, cost: InstanceCost,
                 max_running_requests: int, cache: BlockPrefixCache | None):
        self.sim = sim
        self.role = role
        self.index = index
        self.cost = cost
        self.cache = cache
        self.max_running = max_running_requests
        self.kv_capacity = cost.kv_capacity_tokens
        self.kv_used = 0
        self.reserved: dict = {}           # job -> reserved tokens
        self.admission: deque = deque()    # (job, tokens, on_reserved)
        self.running: dict = {}            # job -> (join_step, start_context, finish_step)
        self._finish_heap: list = []
        self._joining: list = []           # (job, context, steps_to_go, on_finished)
        self._extends: list = []           # (job, tokens, prefix_tokens, on_absorbed)
        self._in_step_extends: list = []
        self._context_offset = 0           # sum over running of (start_context - join_step)
        self.completed_steps = 0
        self.stepping = False
        self.last_step_end_s = 0.0
        self.step_ends_s = 0.0             # when the step in progress ends (if stepping)
        self.host: Host | None = None
        self.busy_seconds = 0.0
        self.itl_histogram: dict = {}      # bin -> tokens that waited that long
        self.traced: set = set()           # jobs whose every token time is recorded
        self.delivery_delay_s = 0.0        # this server's tokens reach the router this much later
        self.finished_callbacks: dict = {}
        self.copies_in_flight: set = set()            # WAN flows of prompts coming here
        self.recent_copies: deque = deque(maxlen=RECENT_COPIES)   # (bytes, seconds) landed

    # --- admission -----------------------------------------------------------------------
    def load(self) -> RelayLoad:
        return RelayLoad(len(self.reserved), self.max_running, self.kv_used, self.kv_capacity)

    def candidate(self, request) -> MainCandidate:
        cached = (self.cache.cached_tokens(request.prompt_blocks, request.input_tokens)
                  if self.cache is not None else 0)
        return MainCandidate(cached, len(self.reserved) + len(self.admission), self.max_running)

    def reserve(self, job, tokens: int, on_reserved) -> None:
        self.admission.append((job, tokens, on_reserved))
        self._admit()

    def release(self, job) -> None:
        tokens = self.reserved.pop(job, None)
        if tokens is not None:
            self.kv_used -= tokens
            self._admit()

    def withdraw(self, job) -> None:
        """Give up a reservation, whether it is still queued or already granted."""
        for position, entry in enumerate(self.admission):
            if entry[0] is job:
                del self.admission[position]
                return
        self.release(job)

    def _admit(self) -> None:
        while self.admission:
            job, tokens, on_reserved = self.admission[0]
            fits = (len(self.reserved) < self.max_running
                    and self.kv_used + tokens <= self.kv_capacity)
            if not fits and self.reserved:
                return
            self.admission.popleft()
            self.reserved[job] = tokens
            self.kv_used += tokens
            on_reserved()

    def until_step_boundary(self) -> float:
        """Seconds until this server's scheduler is next between forwards (0 when idle)."""
        return max(self.step_ends_s - self.sim.now, 0.0) if self.stepping else 0.0

    # --- decoding ------------------------------------------------------------------------
    def start_decoding(self, job, context_tokens: int, steps_to_go: int, on_finished) -> None:
        """Join the batch at the next step; on_finished() after steps_to_go more tokens."""
        self._joining.append((job, context_tokens, steps_to_go, on_finished))
        self._wake()

    def stop_decoding(self, job) -> int:
        """Leave the batch now (a relay handing off); returns the tokens made since joining."""
        state = self.running.pop(job, None)
        if state is None:
            return 0
        join_step, start_context, _ = state
        self._context_offset -= start_context - join_step
        self.finished_callbacks.pop(job, None)
        return self.completed_steps - join_step

    def tokens_made(self, job) -> int:
        state = self.running.get(job)
        return 0 if state is None else self.completed_steps - state[0]

    def is_decoding(self, job) -> bool:
        return job in self.running

    def extend(self, job, tokens: int, prefix_tokens: int, on_absorbed) -> None:
        """Recompute the KV of handed token ids in the next forward pass."""
        self._extends.append((job, tokens, prefix_tokens, on_absorbed))
        self._wake()

    def _wake(self) -> None:
        if not self.stepping:
            self._start_step()

    def _start_step(self) -> None:
        step = self.completed_steps
        for job, context, steps_to_go, on_finished in self._joining:
            self.running[job] = (step, context, step + steps_to_go)
            self._context_offset += context - step
            self.finished_callbacks[job] = on_finished
            heapq.heappush(self._finish_heap, (step + steps_to_go, job.request.request_id, job))
        self._joining = []
        self._in_step_extends, self._extends = self._extends, []
        batch = len(self.running)
        if batch == 0 and not self._in_step_extends:
            self.stepping = False
            if self.host is not None:
                self.host.idle(self)
            return
        context = self._context_offset + batch * step
        duration = self.cost.forward_seconds(
            batch, context, [(tokens, prefix) for _, tokens, prefix, _ in self._in_step_extends])
        if self.host is not None:
            duration = self.host.stretch(self, duration)
        self.stepping = True
        self.busy_seconds += duration
        if batch:
            key = int(duration / ITL_BIN_S)
            self.itl_histogram[key] = self.itl_histogram.get(key, 0) + batch
        self.step_ends_s = self.sim.now + duration
        self.sim.schedule(duration, DecodeStepDone(self))

    def _step_done(self) -> None:
        self.completed_steps += 1
        now = self.sim.now
        self.last_step_end_s = now
        if self.traced:
            for job in self.traced:
                if job in self.running:
                    job.token_times.append(now + self.delivery_delay_s)
        heap = self._finish_heap
        while heap and heap[0][0] <= self.completed_steps:
            finish_step, _, job = heapq.heappop(heap)
            state = self.running.get(job)
            if state is None or state[2] != finish_step:
                continue            # left the batch earlier (handed off)
            self.running.pop(job)
            self._context_offset -= state[1] - state[0]
            self.finished_callbacks.pop(job)()
        extends, self._in_step_extends = self._in_step_extends, []
        for _, _, _, on_absorbed in extends:
            on_absorbed()
        self._start_step()
