"""The plain serving peers (padded batched `generate`, transformers continuous batching): greedy tokens equal bs=1
`generate`, timestamps are sane, the concurrency cap and the arrivals are respected."""

import pytest
import torch

from adaflash_hf.bench.peers import RequestTiming, run_padded_generate, run_transformers_cb

from .conftest import VOCAB, make_tiny_target


MAX_NEW = 12
PEERS = {"padded": run_padded_generate, "cb": run_transformers_cb}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a small shared CPU, torch's default (all cores) can make every tiny step ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(target, prompt, max_new_tokens, eos):
    """Plain bs=1 greedy `generate` (explicit mask: a prompt token equal to the pad id must not be masked)."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def stream():
    """A tiny target, 7 prompts of mixed lengths, an EOS that some greedy continuations hit mid-stream, and the bs=1
    references."""
    target = make_tiny_target(seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 6, 17, 1, 8, 5)]
    free = [reference(target, p, MAX_NEW, None) for p in prompts]
    # the most frequent token among positions 1..MAX_NEW-2 of the continuations: some rows stop early, others do not
    counts = {}
    for row in free:
        for tok in set(row[1:-1]):
            counts[tok] = counts.get(tok, 0) + 1
    eos = max(counts, key=lambda t: (counts[t] < len(prompts), counts[t]))
    refs = [reference(target, p, MAX_NEW, eos) for p in prompts]
    lengths = [len(r) for r in refs]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths  # EOS mid-stream for some rows only
    return target, prompts, eos, refs


def check_timing(results, prompts, arrivals, concurrency):
    assert [r.prompt_index for r in results] == list(range(len(prompts)))
    for r in results:
        assert isinstance(r, RequestTiming)
        assert r.arrival == (arrivals[r.prompt_index] if arrivals else 0.0)
        assert len(r.token_times) == len(r.tokens) >= 1
        assert all(b >= a for a, b in zip(r.token_times, r.token_times[1:]))
        assert r.admitted is not None and r.admitted >= r.arrival
        assert r.token_times[0] > r.admitted
        assert r.ttft > 0 and all(x >= 0 for x in r.itl)
    # never more than `concurrency` requests in flight (admitted and not finished)
    for r in results:
        running = [q for q in results if q.admitted <= r.admitted < q.finish]
        assert len(running) <= concurrency


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_peer_tokens_equal_bs1_generate_queued(stream, peer):
    target, prompts, eos, refs = stream
    results = PEERS[peer](target, prompts, MAX_NEW, 3, None, eos_token_id=eos)
    assert [r.tokens for r in results] == refs
    check_timing(results, prompts, None, 3)
    # 7 requests through 3 slots: someone waited for a slot
    assert max(r.admitted for r in results) > 0


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_peer_respects_arrivals(stream, peer):
    target, prompts, eos, refs = stream
    arrivals = [0.0, 0.0, 0.05, 0.05, 0.12, 0.3, 0.31]
    results = PEERS[peer](target, prompts, MAX_NEW, 2, arrivals, eos_token_id=eos)
    assert [r.tokens for r in results] == refs
    check_timing(results, prompts, arrivals, 2)
    # no needless waiting: a request is taken at the latest once it has arrived and everything admitted before it
    # has finished (generous slack for a loaded machine)
    for r in results:
        idle = max([q.finish for q in results if q.admitted < r.admitted], default=0.0)
        assert r.admitted <= max(r.arrival, idle) + 1.0


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_peer_concurrency_one_is_sequential(stream, peer):
    target, prompts, eos, refs = stream
    results = PEERS[peer](target, prompts[:3], 4, 1, None, eos_token_id=eos)
    assert [r.tokens for r in results] == [ref[:4] for ref in refs[:3]]
    ordered = sorted(results, key=lambda r: r.admitted)
    assert [r.prompt_index for r in ordered] == [0, 1, 2]
    assert all(a.finish < b.admitted for a, b in zip(ordered, ordered[1:]))


def test_padded_shares_step_times_within_a_batch(stream):
    target, prompts, eos, _ = stream
    results = run_padded_generate(target, prompts[:2], MAX_NEW, 2, None, eos_token_id=eos)
    a, b = results
    n = min(len(a.token_times), len(b.token_times))
    assert a.token_times[:n] == b.token_times[:n]  # one step stamps both rows


def test_cb_config_sizing_and_cap():
    from transformers import ContinuousBatchingConfig

    from adaflash_hf.bench.peers import _cb_config

    prompts = [[1] * 300, [1] * 10, [1] * 600]
    cfg = _cb_config(None, prompts, 100, 2)
    assert cfg.max_requests_per_batch == 2
    # the two longest requests (600 + 100 -> 3 pages of 256, 300 + 100 -> 2) above a 15 % safety margin
    assert cfg.num_blocks >= 5 / 0.85
    assert cfg.max_batch_tokens == 902
    given = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=128, max_requests_per_batch=99)
    cfg = _cb_config(given, prompts, 100, 2)
    assert (cfg.num_blocks, cfg.max_batch_tokens, cfg.max_requests_per_batch) == (64, 128, 2)
    assert given.max_requests_per_batch == 99  # the caller's config is not mutated


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_peer_bad_input(stream, peer):
    target, prompts, eos, _ = stream
    with pytest.raises(ValueError):
        PEERS[peer](target, prompts, MAX_NEW, 0, None, eos_token_id=eos)
    with pytest.raises(ValueError):
        PEERS[peer](target, prompts, MAX_NEW, 2, [0.0], eos_token_id=eos)
    with pytest.raises(ValueError):
        PEERS[peer](target, [[]], MAX_NEW, 2, None, eos_token_id=eos)


def test_cb_machinery_verify_and_rollback():
    """The evidence behind docs/transformers_cb_speculation.md: transformers' continuous-batching machinery (paged
    cache, FIFO scheduler, batch processor, IOs; private API, sync mode, no CUDA graphs here) can run greedy
    speculative verification by hand: each decoding request feeds `[last token] + drafts` through the scheduler
    unchanged, one forward returns logits at every query position and the target's hidden states at chosen layers, and
    the KV of rejected drafts is rolled back by moving `position_offset` back. The result equals bs=1 `generate`."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching import RequestState

    target, n_new, block = make_tiny_target(seed=3), 24, 4
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 20)]
    refs = [reference(target, p, n_new, None) for p in prompts]
    cb = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64, max_requests_per_batch=8, page_size=16,
                                  allow_block_sharing=False, use_async_batching=False)
    manager = target.init_continuous_batching(GenerationConfig(do_sample=False, eos_token_id=-1), cb)
    processor = manager._create_batch_processor()
    try:
        states = [RequestState(request_id=f"r{i}", initial_tokens=p, max_new_tokens=n_new, eos_token_id=-1)
                  for i, p in enumerate(prompts)]
        for s in states:
            processor.scheduler.add_waiting_request(s)
        assert processor.prepare_next_batch()  # prefill: a plain continuous-batching step
        processor._generation_step(target)
        processor.update_batch()
        rng = torch.Generator().manual_seed(5)
        rounds = rejected = 0
        while processor.scheduler.active_requests:
            rounds += 1
            drafts = {}
            for s, ref in zip(states, refs):  # a stand-in drafter: the reference continuation, sometimes wrong
                pos = s.generated_len()
                d = ref[pos: min(pos + block, n_new - 1)]
                if d and torch.rand(1, generator=rng).item() < 0.5:
                    j = int(torch.randint(0, len(d), (1,), generator=rng))
                    d = d[:j] + [(d[j] + 1) % VOCAB] + d[j + 1:]
                drafts[s.request_id] = d
                s.tokens_to_process = s.tokens_to_process + d  # [last committed token] + drafts
            assert processor.prepare_next_batch()
            io = processor.inputs_and_outputs
            batch = io.requests_in_batch
            cu = io.cumulative_seqlens_q[: len(batch) + 1].tolist()
            assert [f.query_length for f in batch] == [len(drafts[f.state.request_id]) + 1 for f in batch]
            with torch.no_grad():
                out = target(**io.get_model_kwargs(), output_hidden_states=[1, 3])
            hidden = [h for h in out.hidden_states if h is not None]
            assert [tuple(h.shape) for h in hidden] == [(1, cu[-1], target.config.hidden_size)] * 2
            predicted = out.logits[0].argmax(-1).tolist()  # a logit row for every query token of every request
            for i, f in enumerate(batch):
                s, d = f.state, drafts[f.state.request_id]
                pred = predicted[cu[i]: cu[i + 1]]
                n_acc = 0
                while n_acc < len(d) and d[n_acc] == pred[n_acc]:
                    n_acc += 1
                s.position_offset -= len(d) - n_acc  # roll back the rejected drafts' KV
                rejected += len(d) - n_acc
                for tok in d[:n_acc] + [pred[n_acc]]:
                    if s.update_and_check_completion(tok, None):
                        processor.scheduler.finish_request(s.request_id)
                        break
        assert [s.generated_tokens for s in states] == refs
        assert rejected > 0 and rounds < n_new - 1  # rollbacks happened, and rounds committed several tokens
    finally:
        manager.batch_processor = None
        del processor
