"""Prompts given hashed (kvrouter.HashedPrompt, KVR_REQUEST_PREHASHED): every decision, booking and
price is that of the prompt's tokens; a hash count other than the prompt's complete blocks is
refused; the hashes are read like tokens (in place from a uint64 buffer, for the call only).

Each comparison runs on twin routers built alike and given the same calls in the same order, one
the tokens and the other the hashes, so that their seeded tie-breaks draw alike."""

from __future__ import annotations

import array
import threading
from typing import Iterator, List, Tuple

import numpy as np
import pytest

import kvrouter
from conftest import prompt, wait_for
from kvrouter import HashedPrompt, RequestOptions, StoredEvent

# Three complete blocks and 5 tokens of a fourth: the partial block is in the prompt's length
# (and in the prefill it costs) but has no hash.
TOKENS = prompt(1000, 3) + list(range(9000, 9005))
HASHES = kvrouter.compute_block_hashes(TOKENS, 16)


def twin() -> kvrouter.Router:
    """Four workers; worker 2 caches the prompt's first two blocks, worker 3 them under a LoRA."""
    r = kvrouter.Router(block_size=16, random_seed=7)
    for worker in (1, 2, 3, 4):
        r.add_worker(worker)
    r.apply_stored(StoredEvent(worker_id=2, block_hashes=[0xA1, 0xA2], token_ids=TOKENS[:32]))
    r.apply_stored(StoredEvent(worker_id=3, block_hashes=[0xB1, 0xB2], token_ids=TOKENS[:32],
                               lora_name="adapter"))
    return r


@pytest.fixture
def twins() -> Iterator[Tuple[kvrouter.Router, kvrouter.Router]]:
    with twin() as by_tokens, twin() as by_hashes:
        yield by_tokens, by_hashes


def by_rank(rows: List) -> List:
    return sorted(rows, key=lambda row: (row.worker_id, row.dp_rank))


@pytest.mark.parametrize("hashes", [
    HASHES,
    tuple(HASHES),
    array.array("Q", HASHES),                    # read in place
    np.array(HASHES, dtype=np.uint64),           # read in place
    memoryview(array.array("Q", HASHES)),
    iter(HASHES),                                # made a tuple by HashedPrompt: usable again
], ids=["list", "tuple", "array-Q", "numpy-uint64", "memoryview", "iterator"])
def test_a_hashed_prompt_gets_the_decision_of_its_tokens(twins, hashes):
    by_tokens, by_hashes = twins
    hashed = HashedPrompt(hashes, len(TOKENS))
    res = by_hashes.find_best_match(hashed)
    assert res == by_tokens.find_best_match(TOKENS)
    assert (res.worker_id, res.device_overlap_blocks, res.cached_tokens) == (2, 2, 32)
    assert (res.prompt_tokens, res.prompt_blocks, res.booked) == (len(TOKENS), 3, 0)
    with_candidates = by_hashes.find_best_match_with_candidates(hashed, max_candidates=8)
    assert with_candidates == by_tokens.find_best_match_with_candidates(TOKENS, max_candidates=8)
    assert with_candidates[2] == 4 and with_candidates[0].cost == res.cost
    # Previews (with a pin: the hints take the same path), overlaps and loads agree too.
    preview = by_hashes.preview_route(hashed)
    assert preview == by_tokens.preview_route(TOKENS)
    assert (preview.worker_id, preview.overlap_blocks, preview.prompt_tokens) == (2, 2, len(TOKENS))
    pin = kvrouter.RoutingHints(worker_id=4)
    assert by_hashes.preview_route(hashed, hints=pin) == by_tokens.preview_route(TOKENS, hints=pin)
    assert by_rank(by_hashes.overlap_scores(hashed)) == by_rank(by_tokens.overlap_scores(TOKENS))
    assert by_hashes.potential_loads(hashed) == by_tokens.potential_loads(TOKENS)
    assert by_hashes.metrics().requests_active == 0


def test_the_hashes_carry_the_lora_and_a_short_prompt_has_none(twins):
    by_tokens, by_hashes = twins
    lora = RequestOptions(lora_name="adapter")
    hashed = HashedPrompt(kvrouter.compute_block_hashes(TOKENS, 16, lora_name="adapter"), len(TOKENS))
    res = by_hashes.find_best_match(hashed, lora)
    assert res == by_tokens.find_best_match(TOKENS, lora)
    assert res.worker_id == 3  # it holds the blocks under the adapter
    assert by_rank(by_hashes.overlap_scores(hashed, lora)) == by_rank(by_tokens.overlap_scores(TOKENS, lora))
    # The options' LoRA name is in the hashes: without it the hashes still find worker 3.
    assert by_hashes.find_best_match(hashed).worker_id == 3
    by_tokens.find_best_match(TOKENS, lora)  # the twins keep drawing alike
    short = list(range(7, 7 + 15))
    none = by_hashes.find_best_match(HashedPrompt([], len(short)))
    assert none == by_tokens.find_best_match(short)
    assert (none.prompt_blocks, none.prompt_tokens) == (0, 15)


def test_a_booking_made_from_hashes_weighs_as_one_from_tokens_and_is_freed(twins):
    by_tokens, by_hashes = twins
    hashed = HashedPrompt(array.array("Q", HASHES), len(TOKENS))
    # Booked on a rank chosen elsewhere: worker 4, which caches nothing of it.
    by_tokens.add_request(TOKENS, 4, request_id="d")
    by_hashes.add_request(hashed, 4, request_id="d")
    four = next(load for load in by_hashes.potential_loads(TOKENS) if load.worker_id == 4)
    assert (four.active_requests, four.active_prefill_tokens, four.active_blocks) == (1, len(TOKENS), 3)
    # Admitted routing (the extension's own method), with candidates, and a plan committed.
    res = by_hashes.find_best_match(hashed, request_id="a")
    assert res == by_tokens.find_best_match(TOKENS, request_id="a")
    assert res.booked == 1 and res.worker_id == 2
    opts = RequestOptions(admit=True, request_id="b", expected_output_tokens=64)
    assert (by_hashes.find_best_match_with_candidates(hashed, opts)
            == by_tokens.find_best_match_with_candidates(TOKENS, opts))
    plan = by_hashes.plan_route(hashed, previewed=by_hashes.preview_route(hashed), request_id="c")
    assert plan == by_tokens.plan_route(TOKENS, previewed=by_tokens.preview_route(TOKENS), request_id="c")
    assert plan.booked == 1
    by_tokens.commit_route("c")
    by_hashes.commit_route("c")
    # Each rank carries what it carries for the same requests booked from tokens.
    loads = by_hashes.potential_loads(TOKENS)
    assert loads == by_tokens.potential_loads(TOKENS)
    assert sum(load.active_requests for load in loads) == 4 == by_hashes.metrics().requests_active
    for request_id in "abcd":
        by_tokens.free_request(request_id)
        by_hashes.free_request(request_id)
    assert by_hashes.metrics().requests_active == 0
    for load in by_hashes.potential_loads(hashed):
        assert (load.active_requests, load.active_blocks, load.active_prefill_tokens) == (0, 0, 0)
    assert by_hashes.potential_loads(TOKENS) == by_tokens.potential_loads(TOKENS)


def test_a_hash_count_that_is_not_the_prompts_blocks_is_refused(router):
    with kvrouter.Disagg(kvrouter.RouterOptions(block_size=16), kvrouter.RouterOptions(block_size=16)) as d:
        d.prefill_router.add_worker(10)
        d.decode_router.add_worker(20)
        # One block more than the hashes, one hash too few, hashes for less than a block.
        for bad in (HashedPrompt(HASHES, len(TOKENS) + 16), HashedPrompt(HASHES[:2], len(TOKENS)),
                    HashedPrompt(HASHES, 15)):
            calls = [
                lambda: router.find_best_match(bad),
                lambda: router.find_best_match(bad, request_id="x"),
                lambda: router.find_best_match_with_candidates(bad),
                lambda: router.preview_route(bad),
                lambda: router.plan_route(bad, request_id="x"),
                lambda: router.add_request(bad, 1, request_id="x"),
                lambda: router.overlap_scores(bad),
                lambda: router.potential_loads(bad),
                lambda: d.route_prefill(bad, request_id="x"),
                lambda: d.route_decode(bad, remote_prefill=False, request_id="x"),
                lambda: d.prefill_worker_busy(bad, 1.0),
            ]
            for call in calls:
                with pytest.raises(kvrouter.InvalidArgumentError, match="local hashes were given") as err:
                    call()
                assert err.value.status == kvrouter.Status.INVALID_ARGUMENT
        assert router.metrics().requests_active == 0
        assert d.prefill_router.metrics().requests_active == 0
        assert d.decode_router.metrics().requests_active == 0
    # What HashedPrompt itself refuses.
    with pytest.raises(ValueError, match="num_tokens"):
        HashedPrompt(HASHES, -1)
    with pytest.raises(TypeError):
        HashedPrompt(HASHES, 48.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="local_hashes"):
        HashedPrompt("abc", 48)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        router.find_best_match(HashedPrompt([-1, 2, 3], 48))
    with pytest.raises(TypeError):
        router.find_best_match(HashedPrompt([1.5, 2, 3], 48))  # type: ignore[list-item]


@pytest.mark.parametrize("policy, tokens, remote", [
    (kvrouter.DisaggPolicy.ALWAYS, TOKENS, 1),
    # ISL bounding reads the prompt's length: hashed, 512 tokens go remote as their tokens do
    # (read as no tokens they would stay local), and 32 stay local.
    (kvrouter.DisaggPolicy.ISL_BOUNDING, prompt(1000, 32), 1),
    (kvrouter.DisaggPolicy.ISL_BOUNDING, prompt(1000, 2), 0),
])
def test_the_disaggregated_router_takes_a_hashed_prompt_as_its_tokens(policy, tokens, remote):
    def disagg() -> kvrouter.Disagg:
        pool = kvrouter.RouterOptions(block_size=16, random_seed=7)
        d = kvrouter.Disagg(pool, pool, kvrouter.DisaggOptions(
            policy=policy, max_local_prefill_tokens=64, decode_busy_threshold=0.9))
        d.prefill_router.add_worker(kvrouter.WorkerConfig(10, max_num_batched_tokens=8192))
        d.prefill_router.add_worker(kvrouter.WorkerConfig(11, max_num_batched_tokens=8192))
        d.decode_router.add_worker(kvrouter.WorkerConfig(20, total_kv_blocks=1000))
        d.prefill_router.apply_stored(StoredEvent(worker_id=11, block_hashes=[0xC1, 0xC2],
                                                  token_ids=TOKENS[:32]))
        return d

    hashed = HashedPrompt(np.array(kvrouter.compute_block_hashes(tokens, 16), dtype=np.uint64), len(tokens))
    with disagg() as by_tokens, disagg() as by_hashes:
        pt = by_tokens.route_prefill(tokens, request_id="r")
        ph = by_hashes.route_prefill(hashed, request_id="r")
        assert ph.remote == remote, ph
        # Everything but the bootstrap room, a random draw of each remote prefill.
        def fields(p: kvrouter.PrefillResult) -> dict:
            return {f: getattr(p, f) for f in p.__match_args__ if f != "bootstrap_room"}

        assert fields(ph) == fields(pt)
        if remote:
            assert ph.worker_id == 11  # it caches the prompt's start
        assert (by_hashes.route_decode(hashed, remote_prefill=bool(ph.remote), request_id="r")
                == by_tokens.route_decode(tokens, remote_prefill=bool(pt.remote), request_id="r"))
        assert by_hashes.prefill_worker_busy(hashed, 0.0) == by_tokens.prefill_worker_busy(tokens, 0.0)
        for pool in ("prefill_router", "decode_router"):
            hashes_pool, tokens_pool = getattr(by_hashes, pool), getattr(by_tokens, pool)
            assert hashes_pool.potential_loads(tokens) == tokens_pool.potential_loads(tokens)
            hashes_pool.free_request("r")
            assert hashes_pool.metrics().requests_active == 0


def test_a_buffer_of_hashes_is_held_for_the_call_only_without_the_gil():
    with kvrouter.Router(block_size=16, queue_threshold=0.0) as r:
        r.add_worker(kvrouter.WorkerConfig(1, max_num_batched_tokens=16))
        hashes = array.array("Q", HASHES)
        hashed = HashedPrompt(hashes, len(TOKENS))
        r.find_best_match(hashed, request_id="busy")  # the only rank is now over the threshold
        results = []
        waiter = threading.Thread(target=lambda: results.append(r.find_best_match(hashed, request_id="waiting")))
        waiter.start()
        wait_for("the request to queue", lambda: r.metrics().queue_pending == 1)
        # The waiting call holds no GIL (this thread runs) and reads the array in place: it is
        # exported while the call waits ...
        with pytest.raises(BufferError):
            hashes.append(0)
        assert r.preview_route(hashed).worker_id == 1
        r.mark_prefill_completed("busy")
        waiter.join(10)
        assert results and results[0].queued == 1 and results[0].prompt_tokens == len(TOKENS)
        # ... and released once it returned.
        hashes.append(0)
        hashes.pop()
        r.free_request("busy")
        r.free_request("waiting")
        assert r.metrics().requests_active == 0


@pytest.mark.parametrize("unordered", [set(HASHES), frozenset(HASHES), dict.fromkeys(HASHES)])
def test_hashes_without_an_order_are_refused(unordered):
    # A set's order is not the blocks': its count would pass, and the prompt be misrouted.
    with pytest.raises(TypeError, match="block order"):
        HashedPrompt(unordered, len(TOKENS))
