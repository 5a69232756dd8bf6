# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The plain serving peers a transformers user has today, timed per request for a request-stream benchmark.

A request stream is `N` token-id prompts, either all queued at t=0 (`arrivals=None`) or arriving at given times in
seconds (e.g. Poisson), served with at most `concurrency` requests at once. Both peers return, for each prompt in prompt
order, a `RequestTiming`: its arrival, the time each of its new tokens became available on the host (seconds from the
start of the run, `time.perf_counter()` read after synchronizing the device) and its greedy tokens (EOS included when it
was generated, as `generate` returns it). TTFT is `token_times[0] - arrival`; ITL are the gaps between consecutive
`token_times` (tokens committed together share one timestamp).

  * `run_padded_generate`: transformers' batched `target.generate` (left-padded, greedy) on static batches: when the
    engine is free it takes, in arrival order, up to `concurrency` of the requests that have arrived (waiting for the
    next arrival if none has) and runs them until every row stops. A `StoppingCriteria` stamps each decoding step (the
    first step is the prefill); a row's tokens after its EOS are padding and do not count.
  * `run_transformers_cb`: transformers' continuous batching (`init_continuous_batching`: paged cache, FIFO scheduler,
    model runner; CUDA graphs / async batching wherever transformers turns them on, i.e. with a flash attention
    implementation on CUDA). Requests are submitted with `manager.add_request` at their arrival time;
    `ContinuousBatchingConfig.max_requests_per_batch = concurrency` caps how many run at once (the FIFO scheduler puts
    the active requests first, so a waiting one is admitted only when fewer than `concurrency` are active; the cache is
    sized so that it never is the limit). Token times are transformers' own `record_timestamps`.

Both are greedy; in fp32 their tokens equal plain bs=1 `target.generate(prompt, do_sample=False)` (tested), up to
near-ties that batching (padding / ragged shapes) can flip in low precision.
"""

import copy
import math
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ..generation.cost_model import synchronize


@dataclass
class RequestTiming:
    """One request of a run. Times are seconds from the start of the run.

    `arrival`: when the request arrived (given, or 0 when all are queued at the start); `token_times[k]`: when its
    k-th new token was available; `tokens`: its new token ids (greedy; EOS included if generated); `admitted`: when the
    engine started on it (its batch started / the scheduler took it), None if not known.
    """

    prompt_index: int
    arrival: float
    token_times: list[float]
    tokens: list[int]
    admitted: float | None = None

    @property
    def ttft(self) -> float:
        """Time to first token, from arrival (queueing included)."""
        return self.token_times[0] - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive token times (0 for tokens committed together)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def finish(self) -> float:
        return self.token_times[-1]


def _check_stream(prompts, max_new_tokens, concurrency, arrivals) -> list[float]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if arrivals is None:
        return [0.0] * len(prompts)
    arrivals = [float(a) for a in arrivals]
    if len(arrivals) != len(prompts):
        raise ValueError(f"{len(arrivals)} arrivals for {len(prompts)} prompts")
    if any(not math.isfinite(a) or a < 0 for a in arrivals):
        raise ValueError("arrivals must be finite and >= 0 (seconds from the start of the run)")
    return arrivals


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return {int(i) for i in ids if int(i) >= 0}


class _StepClock(StoppingCriteria):
    """Never stops anything; records when each decoding step's tokens are on the device (the first is the prefill)."""

    def __init__(self, device, t0: float):
        self.device, self.t0, self.times = device, t0, []

    def __call__(self, input_ids, scores, **kwargs):
        synchronize(self.device)
        self.times.append(time.perf_counter() - self.t0)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def run_padded_generate(target, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                        arrivals: list[float] | None = None, pad_token_id: int | None = None,
                        eos_token_id: int | list[int] | None = None) -> list[RequestTiming]:
    """Serve the stream with static left-padded batches of `target.generate` (see the module docstring).

    `eos_token_id=None` uses the target's generation config; `pad_token_id=None` pads with the (first) EOS, or 0.
    """
    arrivals = _check_stream(prompts, max_new_tokens, concurrency, arrivals)
    if eos_token_id is None:
        eos_token_id = target.generation_config.eos_token_id
    eos = _eos_set(eos_token_id)
    if pad_token_id is None:
        pad_token_id = min(eos) if eos else 0
    device = target.device
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    results: dict[int, RequestTiming] = {}
    synchronize(device)
    t0 = time.perf_counter()
    head = 0
    while head < len(order):
        now = time.perf_counter() - t0
        if arrivals[order[head]] > now:  # idle until the next request arrives
            time.sleep(arrivals[order[head]] - now)
            now = time.perf_counter() - t0
        batch = []
        while head < len(order) and len(batch) < concurrency and arrivals[order[head]] <= now:
            batch.append(order[head])
            head += 1
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            mask[row, width - len(prompts[i]):] = 1
        clock = _StepClock(device, t0)
        out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                              stopping_criteria=StoppingCriteriaList([clock]))
        new = out[:, width:].tolist()
        if len(clock.times) < len(new[0]):
            raise RuntimeError(f"{len(clock.times)} step times for {len(new[0])} generated positions")
        for row, i in enumerate(batch):
            tokens = new[row]
            for j, tok in enumerate(tokens):
                if tok in eos:
                    tokens = tokens[: j + 1]
                    break
            results[i] = RequestTiming(i, arrivals[i], clock.times[: len(tokens)], tokens, admitted=now)
    return [results[i] for i in range(len(prompts))]


def _cb_config(base, prompts, max_new_tokens, concurrency):
    """The continuous-batching config of a run: `base` (or transformers' defaults) with `max_requests_per_batch =
    concurrency`, and, where `base` leaves them unset, a cache holding `concurrency` of the longest requests with
    room above the FIFO scheduler's safety margin, and a token budget that prefills `concurrency` of the longest
    prompts in one step (capped at transformers' default 8192)."""
    from transformers import ContinuousBatchingConfig

    cfg = copy.deepcopy(base) if base is not None else ContinuousBatchingConfig()
    cfg.max_requests_per_batch = concurrency
    longest = sorted((len(p) for p in prompts), reverse=True)[:concurrency]
    if cfg.num_blocks is None:
        blocks = sum(math.ceil((n + max_new_tokens) / cfg.page_size) for n in longest)
        margin = cfg.safety_margin if cfg.safety_margin is not None else 0.15  # FIFOScheduler's default
        cfg.num_blocks = math.ceil(blocks / (1.0 - margin)) + 1
    if cfg.max_batch_tokens is None:
        cfg.max_batch_tokens = min(8192, max(64, sum(longest) + concurrency))
    return cfg


@torch.inference_mode()
def run_transformers_cb(target, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                        arrivals: list[float] | None = None, eos_token_id: int | list[int] | None = None, *,
                        continuous_batching_config=None, warmup: bool = True,
                        timeout_s: float = 600.0) -> list[RequestTiming]:
    """Serve the stream with transformers' continuous batching (see the module docstring).

    `continuous_batching_config`: a `ContinuousBatchingConfig` to start from (its `max_requests_per_batch` is replaced
    by `concurrency`; unset `num_blocks` / `max_batch_tokens` are sized for the stream). `warmup`: run the manager's
    warmup (CUDA-graph capture / compile, a no-op otherwise) before the clock starts. `eos_token_id=None` uses the
    target's generation config. Raises if a request fails or the run exceeds `timeout_s`.
    """
    from transformers.generation.continuous_batching.utils import WorkloadHints

    arrivals = _check_stream(prompts, max_new_tokens, concurrency, arrivals)
    # Greedy with the target's own generation config (so the logits processors are the ones `generate` would use).
    gen_cfg = copy.deepcopy(target.generation_config) if target.generation_config is not None else GenerationConfig()
    gen_cfg.do_sample = False
    gen_cfg.num_return_sequences = 1
    gen_cfg.max_new_tokens = max_new_tokens
    if eos_token_id is not None:
        gen_cfg.eos_token_id = eos_token_id
    eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else -1
    cb_cfg = _cb_config(continuous_batching_config, prompts, max_new_tokens, concurrency)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max_new_tokens,
                          num_requests=len(prompts))
    manager = target.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                              workload_hints=hints)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    outputs = {}
    try:
        if warmup and not manager.warmed_up:
            manager.warmup()
        synchronize(target.device)
        t0 = time.perf_counter()
        manager.start()
        head = 0
        while len(outputs) < len(prompts):
            now = time.perf_counter() - t0
            if now > timeout_s:
                raise TimeoutError(f"continuous batching run exceeded {timeout_s} s ({len(outputs)} requests done)")
            while head < len(order) and arrivals[order[head]] <= now:
                i = order[head]
                if manager.add_request(list(prompts[i]), request_id=f"req_{i}", max_new_tokens=max_new_tokens,
                                       record_timestamps=True, eos_token_id=eos) is None:
                    raise RuntimeError(f"continuous batching manager refused request {i}")
                head += 1
            wait = arrivals[order[head]] - now if head < len(order) else 0.5
            result = manager.get_result(timeout=max(1e-4, min(wait, 0.5)))
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("continuous batching generation thread stopped unexpectedly")
                continue
            if result.error is not None:
                raise RuntimeError(f"continuous batching request {result.request_id} failed: {result.error}")
            if result.is_finished():
                outputs[int(result.request_id.removeprefix("req_"))] = result
    finally:
        manager.stop(block=True, timeout=30, keep_for_next_session=False)
        manager.destroy()
    results = []
    for i in range(len(prompts)):
        out = outputs[i]
        times = [ts - t0 for ts in (out.timestamps or [])]
        if len(times) != len(out.generated_tokens):
            raise RuntimeError(f"request {i}: {len(times)} timestamps for {len(out.generated_tokens)} tokens")
        admitted = out.lifespan[0] - t0 if out.lifespan[0] >= 0 else None
        results.append(RequestTiming(i, arrivals[i], times, list(out.generated_tokens), admitted=admitted))
    return results
