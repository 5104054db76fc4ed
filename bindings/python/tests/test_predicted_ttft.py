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


def test_predicted_ttft_prices_seconds_at_the_learnt_rate():
    """Every request's prefill completes 100 ms after its booking on the router's clock: the
    fleet's rate is learnt as 560 / 0.1 = 5,600 tokens per second, one rate for every rank. A
    fresh 512-token prompt is then priced in seconds at that rate, (backlog + 512) / rate +
    3 x 512 / rate, so worker 1, with a 512-token backlog, is avoided; the credit form, asked for
    this request only, prices blocks again."""
    warm_blocks, prefill_blocks = 35, 32  # 560 and 512 tokens
    rate = warm_blocks * 16 / 0.1
    prefill = prefill_blocks * 16
    with kvrouter.Router(block_size=16, random_seed=7, cost_function=CostFunction.PREDICTED_TTFT) as router:
        for w in range(1, WORKERS + 1):
            router.add_worker(w)
        now = 5_000_000_000
        router.set_time(now)
        warm = prompt(1, warm_blocks)
        for i in range(4):
            for w in range(1, WORKERS + 1):
                name = f"warm-{w}-{i}"
                router.add_request(warm, w, request_id=name)
                now += 100_000_000
                router.set_time(now)
                router.mark_prefill_completed(name)
                router.free_request(name)
        router.add_request(prompt(100_000, prefill_blocks), 1, request_id="backlog")
        fresh = prompt(500_000, prefill_blocks)  # cached nowhere
        res, cands, total = router.find_best_match_with_candidates(fresh)
        assert total == WORKERS and res.worker_id != 1, cands
        for c in cands:
            # (backlog + 512) / rate + 3 x 512 / rate: 0.457 s behind worker 1's backlog, 0.366 s.
            backlog = prefill if c.worker_id == 1 else 0
            assert c.cost == pytest.approx((backlog + 4 * prefill) / rate, rel=0, abs=1e-9), c
        # The credit form, asked for this request only, prices blocks: 512 / 16 + 32 new = 64.
        res = router.find_best_match(fresh, RequestOptions(cost_function=CostFunction.CREDIT))
        assert res.cost == 64.0
        # Time never goes back.
        with pytest.raises(kvrouter.InvalidArgumentError, match="earlier"):
            router.set_time(now - 1)
