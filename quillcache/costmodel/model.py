"""Time estimates for prefill, decode, KV transfer and queueing.

A roofline model: prefill is compute-bound (linear FLOPs in new tokens plus attention
FLOPs that grow with the context), decode is memory-bound (weights once per step plus
every running sequence's KV). Parameters and their sources: `docs/simulator.md`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from quillcache._native import CostKernel
from quillcache.costmodel.config import CostModelConfig

#: A column of per-worker numbers (counts are exact in float64 below 2**53).
Column = npt.NDArray[np.float64] | npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]

GIB = 1024**3


@overload
def prefill_pairs(new_tokens: float, context_tokens: float) -> float: ...
@overload
def prefill_pairs(new_tokens: Column, context_tokens: Column) -> Floats: ...
def prefill_pairs(new_tokens: Any, context_tokens: Any) -> Any:
    """The attention (query, key) pairs of prefilling `new_tokens` after
    `context_tokens` cached ones: each new token attends to the context and to the new
    tokens up to itself. What an engine's queue books per request, so that its queue is
    priced as the requests it holds, not as one prompt of their summed length."""
    return new_tokens * (context_tokens + (new_tokens + 1) / 2.0)


def booked_pairs(prefill_tokens: float, prompt_tokens: float) -> float:
    """`prefill_pairs` of a request booked with `prefill_tokens` to compute of a prompt
    of `prompt_tokens` (the rest cached); a prompt given as shorter than its prefill
    (not known) counts as no context. What every load store books, so that a prefill
    or a release takes away exactly what the booking added."""
    return prefill_pairs(prefill_tokens, max(prompt_tokens - prefill_tokens, 0))


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """The parts of a time-to-first-token estimate, in seconds."""

    queue_s: float
    transfer_s: float
    prefill_s: float
    decode_s: float  # one decode step: the first token comes out of the prefill step's
    # sampling, the second after a step shared with the worker's running decodes (TBT)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


class CostModel:
    """Estimates from a `CostModelConfig`; cheap enough to call per (request, worker)."""

    def __init__(self, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        c = self.config
        self._flops_per_s = c.gpu.peak_tflops * 1e12 * c.gpu.prefill_mfu
        self._bytes_per_s = c.gpu.hbm_gbps * 1e9 * c.gpu.decode_mbu
        self._linear_flops_per_token = 2.0 * c.model.params_billion * 1e9
        # QK^T and AV: 2 matmuls x 2 FLOPs x hidden per (query, key) pair per layer.
        self._attn_flops_per_pair = 4.0 * c.model.layers * c.model.hidden_size
        self._weight_read_s = c.model.weight_bytes / self._bytes_per_s
        self._kv_read_s_per_token = c.model.kv_bytes_per_token / self._bytes_per_s
        self.overhead_s = c.gpu.step_overhead_s
        self.block_size = c.engine.block_size
        self.chunk_budget = c.engine.max_num_batched_tokens
        self.max_num_seqs = c.engine.max_num_seqs
        t = c.transfer
        #: The `*_array` estimates below, as the routers score a fleet with them in one
        #: pass (`quillcache.routing.kernels`); these methods stay the reference.
        self.kernel = CostKernel(
            linear_flops_per_token=self._linear_flops_per_token,
            attn_flops_per_pair=self._attn_flops_per_pair,
            flops_per_s=self._flops_per_s,
            overhead_s=self.overhead_s,
            weight_read_s=self._weight_read_s,
            kv_read_s_per_token=self._kv_read_s_per_token,
            chunk_budget=self.chunk_budget,
            block_size=self.block_size,
            kv_bytes_per_token=c.model.kv_bytes_per_token,
            transfer_latency_s=t.latency_s,
            cpu_gbps=t.cpu_to_gpu_gbps,
            disk_gbps=t.disk_to_gpu_gbps,
            peer_gbps=t.peer_gbps,
            allow_peer_fetch=t.allow_peer_fetch,
            max_num_seqs=c.engine.max_num_seqs,
        )

    def __reduce__(self) -> tuple[type[CostModel], tuple[CostModelConfig]]:
        # everything derives from the config (the native kernel does not pickle)
        return (CostModel, (self.config,))

    # --- engine step -------------------------------------------------------------

    def prefill_compute_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Pure compute time to prefill `new_tokens` after `context_tokens` cached ones."""
        if new_tokens <= 0:
            return 0.0
        pairs = prefill_pairs(new_tokens, context_tokens)
        flops = self._linear_flops_per_token * new_tokens + self._attn_flops_per_pair * pairs
        return flops / self._flops_per_s

    def queued_compute_s(self, queued_tokens: float, queued_pairs: float) -> float:
        """Pure compute time of an engine's queued prefill: `queued_tokens` new tokens of
        several requests whose attention pairs sum to `queued_pairs` (`prefill_pairs`
        of each). Every queued token attends at least to itself, so fewer pairs than
        tokens (an engine that reports its queued tokens but not their pairs) count as
        that many."""
        if queued_tokens <= 0:
            return 0.0
        pairs = max(queued_pairs, queued_tokens)
        flops = self._linear_flops_per_token * queued_tokens + self._attn_flops_per_pair * pairs
        return flops / self._flops_per_s

    def step_time(
        self, prefill_flops_s: float, decode_batch: int, decode_context_tokens: int
    ) -> float:
        """One engine step: the weights are read once (decode is memory-bound, prefill
        compute-bound, they overlap), every decoding sequence's KV is read, plus a fixed
        scheduler/sampling overhead."""
        if prefill_flops_s <= 0 and decode_batch <= 0:
            return 0.0
        return (
            self.overhead_s
            + max(prefill_flops_s, self._weight_read_s)
            + decode_context_tokens * self._kv_read_s_per_token
        )

    def kv_read_s(self, tokens: float) -> float:
        """Time one decode step spends reading `tokens` tokens of KV."""
        return tokens * self._kv_read_s_per_token

    def decode_step_time(self, batch: int, mean_context_tokens: float) -> float:
        return self.step_time(0.0, batch, int(batch * mean_context_tokens))

    def prefill_time(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Wall time to prefill alone, in chunks of the engine's token budget: each chunk
        step pays the overhead and at least one read of the weights."""
        if new_tokens <= 0:
            return 0.0
        steps = -(-new_tokens // self.chunk_budget)
        return steps * self.overhead_s + max(
            self.prefill_compute_s(new_tokens, context_tokens), steps * self._weight_read_s
        )

    def loaded_prefill_time(
        self,
        *,
        queued_tokens: float,
        queued_pairs: float,
        new_tokens: int,
        context_tokens: int,
        running_decodes: float,
        mean_context_tokens: float,
    ) -> float:
        """Time until a new request's prefill completes on a busy worker: its queued
        prefill and this one share steps with the running decodes, which take one token
        of each step's budget and add their KV reads to every step."""
        new_tokens = max(new_tokens, 1)
        total = queued_tokens + new_tokens
        budget = max(self.chunk_budget - running_decodes, 1)
        steps = -(-total // budget)
        compute = self.queued_compute_s(queued_tokens, queued_pairs) + self.prefill_compute_s(
            new_tokens, context_tokens
        )
        per_step = self.overhead_s + (
            running_decodes * mean_context_tokens * self._kv_read_s_per_token
        )
        return steps * per_step + max(compute, steps * self._weight_read_s)

    def packed_prefill_time(
        self,
        *,
        queued_tokens: float,
        queued_pairs: float,
        new_tokens: int,
        context_tokens: int,
        running_decodes: float,
        mean_context_tokens: float,
    ) -> float:
        """`loaded_prefill_time` as a promise, with two things chunked prefill does
        to a request that finds prefill queued ahead of it:

        - the step in progress was planned before it came and is not joined: with
          less than a step's budget queued, the whole queue may be in that step, and
          the request's own prefill starts at the next one;
        - its last step is planned after later requests have joined the queue, and the
          engine fills that step's budget with their chunks (first come, first served);
          its first token comes when the whole step ends.

        How much of that last step's room later requests take is not known here; the
        queue ahead is the sign of how fast work arrives, so the room counts as filled
        in the share the queue is of a step's budget (all of it from a full step
        queued on). The filling work costs the compute per token of the queue and the
        request. With nothing queued ahead its prefill starts at the next step, and the
        estimate is `loaded_prefill_time`'s."""
        loaded = self.loaded_prefill_time(
            queued_tokens=queued_tokens,
            queued_pairs=queued_pairs,
            new_tokens=new_tokens,
            context_tokens=context_tokens,
            running_decodes=running_decodes,
            mean_context_tokens=mean_context_tokens,
        )
        if queued_tokens <= 0:
            return loaded
        own = max(new_tokens, 1)
        total = queued_tokens + own
        budget = max(self.chunk_budget - running_decodes, 1)
        steps = max(-(-total // budget), 1 - (-own // budget))
        compute = self.queued_compute_s(queued_tokens, queued_pairs) + self.prefill_compute_s(
            own, context_tokens
        )
        filled = (steps * budget - total) * min(queued_tokens / budget, 1.0)
        compute += filled * (compute / total)
        per_step = self.overhead_s + (
            running_decodes * mean_context_tokens * self._kv_read_s_per_token
        )
        return max(loaded, steps * per_step + max(compute, steps * self._weight_read_s))

    # --- transfer ----------------------------------------------------------------

    def transfer_time(self, blocks: int, tier: str) -> float:
        """Time to bring `blocks` KV blocks to the GPU from `tier` ("cpu", "disk", "peer")."""
        if blocks <= 0:
            return 0.0
        t = self.config.transfer
        gbps = {"cpu": t.cpu_to_gpu_gbps, "disk": t.disk_to_gpu_gbps, "peer": t.peer_gbps}[tier]
        nbytes = blocks * self.block_size * self.config.model.kv_bytes_per_token
        return t.latency_s + nbytes / (gbps * 1e9)

    # --- capacity ----------------------------------------------------------------

    def kv_capacity_blocks(self, block_size: int | None = None) -> int:
        """GPU KV blocks a worker has (vLLM: memory x utilisation - weights - activations)."""
        c = self.config
        bs = block_size or c.engine.block_size
        if c.engine.kv_capacity_blocks is not None:
            return c.engine.kv_capacity_blocks
        free = (
            c.gpu.memory_gb * GIB * c.engine.gpu_memory_utilization
            - c.model.weight_bytes
            - c.engine.activation_reserve_gb * GIB
        )
        return max(1, int(free // (bs * c.model.kv_bytes_per_token)))

    def kv_gib(self, blocks: int, block_size: int | None = None) -> float:
        """GiB of KV that `blocks` blocks of `block_size` tokens (the engine's) hold."""
        bs = block_size or self.block_size
        return blocks * bs * self.config.model.kv_bytes_per_token / GIB

    def kv_gib_limit(self) -> float:
        """The most KV one GPU could hold: its memory less the weights (before vLLM's
        utilisation cap and activation reserve, which `kv_capacity_blocks` applies)."""
        c = self.config
        return (c.gpu.memory_gb * GIB - c.model.weight_bytes) / GIB

    def kv_memory_warning(self, blocks: int, block_size: int | None = None) -> str | None:
        """A one-line warning when `blocks` blocks per engine cannot fit on the GPU
        beside the weights, None when they can."""
        need, limit = self.kv_gib(blocks, block_size), self.kv_gib_limit()
        if need <= limit:
            return None
        c = self.config
        bs = block_size or self.block_size
        return (
            f"{blocks:,} KV blocks of {bs} tokens per engine need {need:,.1f} GiB "
            f"({c.model.kv_bytes_per_token / 1024:g} KiB/token); the cost model's "
            f"{c.gpu.name} holds at most {limit:,.1f} GiB of KV ({c.gpu.memory_gb:g} GiB "
            f"less {c.model.weight_bytes / GIB:.1f} GiB of {c.model.name} weights): timed "
            "results at this capacity are not physically plausible"
        )

    # --- router-facing estimate ----------------------------------------------------

    def queue_time(self, queued_prefill_tokens: float, queued_prefill_pairs: float) -> float:
        """Time until a new request's prefill starts: the worker's queued prefill work,
        each queued request's tokens attending to its own context
        (`queued_compute_s`), at the full chunk budget."""
        if queued_prefill_tokens <= 0:
            return 0.0
        steps = -(-queued_prefill_tokens // self.chunk_budget)
        return (
            self.queued_compute_s(queued_prefill_tokens, queued_prefill_pairs)
            + steps * self.overhead_s
        )

    def estimate_ttft(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        fetched_blocks: int = 0,
        fetch_tier: str = "cpu",
        queued_prefill_tokens: float = 0,
        queued_prefill_pairs: float = 0,
        running_decodes: int = 0,
        mean_context_tokens: float = 0.0,
    ) -> TtftEstimate:
        """Estimate TTFT on one worker. `cached_tokens` includes fetched blocks' tokens."""
        new = max(prompt_tokens - cached_tokens, 1)  # the engine always computes >= 1 token
        return TtftEstimate(
            queue_s=self.queue_time(queued_prefill_tokens, queued_prefill_pairs),
            transfer_s=self.transfer_time(fetched_blocks, fetch_tier),
            prefill_s=self.prefill_time(new, prompt_tokens - new),
            decode_s=self.decode_step_time(running_decodes + 1, mean_context_tokens),
        )

    # --- the same estimates over columns (routers scoring a fleet at once) ----------
    # Each is its scalar namesake applied per element, operation for operation, so the
    # results are bit-identical to a loop (`tests/costmodel/test_arrays.py`).

    def prefill_compute_s_array(self, new_tokens: Column, context_tokens: Column) -> Floats:
        pairs = prefill_pairs(new_tokens, context_tokens)
        flops = self._linear_flops_per_token * new_tokens + self._attn_flops_per_pair * pairs
        return np.where(new_tokens <= 0, 0.0, flops / self._flops_per_s)

    def queued_compute_s_array(self, queued_tokens: Column, queued_pairs: Column) -> Floats:
        pairs = np.maximum(queued_pairs, queued_tokens)
        flops = self._linear_flops_per_token * queued_tokens + self._attn_flops_per_pair * pairs
        return np.where(queued_tokens <= 0, 0.0, flops / self._flops_per_s)

    def queue_time_array(
        self, queued_prefill_tokens: Column, queued_prefill_pairs: Column
    ) -> Floats:
        q = queued_prefill_tokens
        steps = -(-q // self.chunk_budget)
        t = self.queued_compute_s_array(q, queued_prefill_pairs) + steps * self.overhead_s
        return np.where(q <= 0, 0.0, t)

    def prefill_time_array(self, new_tokens: Column, context_tokens: Column) -> Floats:
        steps = -(-new_tokens // self.chunk_budget)
        t = steps * self.overhead_s + np.maximum(
            self.prefill_compute_s_array(new_tokens, context_tokens), steps * self._weight_read_s
        )
        return np.where(new_tokens <= 0, 0.0, t)

    def loaded_prefill_time_array(
        self,
        *,
        queued_tokens: Column,
        queued_pairs: Column,
        new_tokens: Column,
        context_tokens: Column,
        running_decodes: Column,
        mean_context_tokens: Column,
    ) -> Floats:
        new_tokens = np.maximum(new_tokens, 1)
        total = queued_tokens + new_tokens
        budget = np.maximum(self.chunk_budget - running_decodes, 1)
        steps = -(-total // budget)
        compute = self.queued_compute_s_array(
            queued_tokens, queued_pairs
        ) + self.prefill_compute_s_array(new_tokens, context_tokens)
        per_step = self.overhead_s + (
            running_decodes * mean_context_tokens * self._kv_read_s_per_token
        )
        return steps * per_step + np.maximum(compute, steps * self._weight_read_s)

    def transfer_time_array(self, blocks: Column, tier: str) -> Floats:
        t = self.config.transfer
        gbps = {"cpu": t.cpu_to_gpu_gbps, "disk": t.disk_to_gpu_gbps, "peer": t.peer_gbps}[tier]
        nbytes = blocks * self.block_size * self.config.model.kv_bytes_per_token
        return np.where(blocks <= 0, 0.0, t.latency_s + nbytes / (gbps * 1e9))

    def kv_read_s_array(self, tokens: Floats) -> Floats:
        return tokens * self._kv_read_s_per_token

    def slot_wait_time_array(
        self,
        in_flight: Column,
        running_decodes: Column,
        mean_context_tokens: Column,
        output_tokens: int,
        slots: Column | None = None,
    ) -> Floats:
        """Time until a sequence slot frees for a new request: an engine runs at most
        `max_num_seqs` sequences (per engine: `slots`, where it is not 0), so with
        `in_flight` requests there (running and waiting) the new one waits for
        `ceil((in_flight - slots + 1) / slots)` rounds, each the decode of
        `output_tokens` (the request's own, for want of the others') in a full batch; 0
        while a slot is free. The default 256 slots are rarely all taken; an engine
        configured with few (long contexts, little memory) is, and then a cached prefix
        behind a busy slot is worth less than an idle engine."""
        default = float(self.max_num_seqs)
        cap: float | Floats = default if slots is None else np.where(slots > 0, slots, default)
        over = in_flight - cap + 1.0
        rounds = np.ceil(np.maximum(over, 0.0) / cap)
        batch = np.minimum(np.maximum(running_decodes, 1.0), cap)
        return rounds * output_tokens * self.decode_step_time_array(batch, mean_context_tokens)

    def slot_wait_time(
        self,
        in_flight: float,
        running_decodes: float,
        mean_context_tokens: float,
        output_tokens: int,
        slots: float = 0.0,
    ) -> float:
        """`slot_wait_time_array` for one engine (`slots` 0: `max_num_seqs`)."""
        return float(
            self.slot_wait_time_array(
                np.asarray([in_flight], dtype=np.float64),
                np.asarray([running_decodes], dtype=np.float64),
                np.asarray([mean_context_tokens], dtype=np.float64),
                output_tokens,
                np.asarray([slots], dtype=np.float64),
            )[0]
        )

    def decode_step_time_array(self, batch: Column, mean_context_tokens: Column) -> Floats:
        # step_time(0.0, batch, int(batch * mean_context_tokens))
        context = np.trunc(batch * mean_context_tokens)
        t = self.overhead_s + max(0.0, self._weight_read_s) + context * self._kv_read_s_per_token
        return np.where(batch <= 0, 0.0, t)
