"""The predicted-TTFT cost (RouterOptions.cost_function, its per-request overrides) and the
router's clock driven by hand (Router.set_time)."""

from __future__ import annotations

import math

import pytest

import kvrouter
from conftest import prompt
from kvrouter import CostFunction, RequestOptions, RouterOptions

WORKERS = 4


def test_options_defaults_and_bad_values():
    d = RouterOptions()
    assert d.cost_function is CostFunction.CREDIT
    assert (d.ttft_miss_weight, d.prefill_tokens_per_second) == (3.0, 0.0)
    r = RequestOptions()
    assert (r.cost_function, r.ttft_miss_weight) == (None, None)
    assert r._fields()["cost_function"] == -1 and math.isnan(r._fields()["ttft_miss_weight"])
    assert RequestOptions(cost_function=CostFunction.PREDICTED_TTFT)._fields()["cost_function"] == 1

    for bad in ({"ttft_miss_weight": -1.0}, {"ttft_miss_weight": math.inf},
                {"cost_function": 9},
                {"cost_function": CostFunction.PREDICTED_TTFT, "track_prefill_tokens": False}):
        with pytest.raises(kvrouter.InvalidArgumentError):
            kvrouter.Router(block_size=16, **bad)
    with kvrouter.Router(block_size=16) as router:
        router.add_worker(1)
        p = prompt(1, 2)
        with pytest.raises(kvrouter.InvalidArgumentError, match="ttft_miss_weight"):
            router.find_best_match(p, RequestOptions(ttft_miss_weight=-1.0))
        with pytest.raises(kvrouter.InvalidArgumentError, match="cost_function"):
            router.find_best_match(p, RequestOptions(cost_function=7))  # type: ignore[arg-type]
        router.find_best_match(p, RequestOptions(cost_function=CostFunction.PREDICTED_TTFT, ttft_miss_weight=0.5))
        # Time never goes back.
        router.set_time(5_000_000_000)
        router.set_time(5_000_000_000)
        with pytest.raises(kvrouter.InvalidArgumentError, match="earlier"):
            router.set_time(4_999_999_999)
        with pytest.raises(TypeError):
            router.set_time(1.5)  # type: ignore[arg-type]


def test_predicted_ttft_follows_the_calibrated_rates():
    """Worker 1 prefills ten times as fast as the others (its requests complete in 10 ms of the
    router's clock, theirs in 100 ms): with a 512-token backlog it still gives a fresh 512-token
    prompt its first token soonest, which the predicted-TTFT cost sees and the credit form does
    not."""
    with kvrouter.Router(block_size=16, random_seed=7, cost_function=CostFunction.PREDICTED_TTFT) as router:
        for w in range(1, WORKERS + 1):
            router.add_worker(w)
        now = 5_000_000_000
        router.set_time(now)
        warm = prompt(1, 32)
        for i in range(16):
            for w in range(1, WORKERS + 1):
                name = f"warm-{w}-{i}"
                router.add_request(warm, w, request_id=name)
                now += 10_000_000 if w == 1 else 100_000_000
                router.set_time(now)
                router.mark_prefill_completed(name)
                router.free_request(name)
        router.add_request(prompt(100_000, 32), 1, request_id="backlog")
        fresh = prompt(500_000, 32)  # cached nowhere
        res, cands, total = router.find_best_match_with_candidates(fresh)
        assert (res.worker_id, total) == (1, WORKERS)
        # Seconds: (backlog + 3 x 512 tokens) at thousands of tokens per second.
        assert all(0 < c.cost < 1 for c in cands), cands
        # The credit form, asked for this request only, avoids worker 1's backlog.
        res = router.find_best_match(fresh, RequestOptions(cost_function=CostFunction.CREDIT))
        assert res.worker_id != 1
