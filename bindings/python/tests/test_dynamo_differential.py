"""kvrouter.dynamo against Dynamo itself: the ai-dynamo-runtime 1.6.1 wheel (dynamo.llm),
installed from PyPI into the test venv by scripts/test-python.sh, is the oracle. Nothing of it
is copied: both sides get the same inputs and their outputs are compared.

Outside that venv (no dynamo.llm) these tests are skipped, unless KVR_REQUIRE_DYNAMO=1 (set by
scripts/test-python.sh), which makes a missing oracle a failure."""

from __future__ import annotations

import json
import os
import random
from typing import Dict, List, Optional, Tuple

import pytest

import kvrouter
from kvrouter import dynamo as kd

try:
    from dynamo import llm as dl
except ImportError:  # pragma: no cover - depends on the venv
    if os.environ.get("KVR_REQUIRE_DYNAMO") == "1":
        raise
    pytest.skip("ai-dynamo-runtime (dynamo.llm) is not installed", allow_module_level=True)

MASK = (1 << 64) - 1


def mix(*xs: int) -> int:
    """A deterministic 64-bit hash of integers (splitmix64 over them)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & MASK)) * 0xBF58476D1CE4E5B9 & MASK
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & MASK
        h ^= h >> 29
    return h


# ---- compute_block_hash_for_seq


CASES = 1200  # per run; the issue asks for at least 1,000


def test_block_hashes_agree_on_random_inputs():
    """Random prompts, block sizes and options through both compute_block_hash_for_seq. Each
    case draws one of five kinds (plain, LoRA, namespace salt, multimodal, eagle) and then,
    half the time, mixes in the other options at random; every kind must come up often."""
    rng = random.Random(1)
    kinds: Dict[str, int] = {}
    exercised: Dict[str, int] = {}  # cases whose hashes actually depend on the option
    for _ in range(CASES):
        kind = rng.choice(["plain", "lora", "namespace", "multimodal", "eagle"])
        kinds[kind] = kinds.get(kind, 0) + 1
        block = rng.choice([1, 2, 3, 7, 16, 32, 64])
        tokens = [rng.randrange(1 << 32) if rng.random() < 0.1 else rng.randrange(50000)
                  for _ in range(rng.randrange(block, 6 * block + 5))]
        mixed = kind != "plain" and rng.random() < 0.5
        kwargs: Dict = {}
        if kind == "lora" or (mixed and rng.random() < 0.3):
            kwargs["lora_name"] = rng.choice(["", "adapter-a", "lora/β"])
        if kind == "namespace" or (mixed and rng.random() < 0.3):
            kwargs["cache_namespace"] = rng.choice(["", "tenant-1", "ns", "salt-é"])
        if kind == "eagle" or (mixed and rng.random() < 0.3):
            kwargs["is_eagle"] = kind == "eagle" or rng.random() < 0.5
        if kind == "multimodal" or (mixed and rng.random() < 0.3):
            infos = []
            for _ in range(rng.randrange(1, len(tokens) // block + 3)):
                if rng.random() < 0.3:
                    infos.append(None)
                else:
                    infos.append({"mm_objects": [{"mm_hash": rng.randrange(1 << 64), "offsets": [[0, 1]]}
                                                 for _ in range(rng.randrange(0, 4))]})
            kwargs["block_mm_infos"] = infos
        want = dl.compute_block_hash_for_seq(tokens, block, **kwargs)
        got = kd.compute_block_hash_for_seq(tokens, block, **kwargs)
        assert got == want, (block, len(tokens), kwargs)
        plain = dl.compute_block_hash_for_seq(tokens, block)
        for option in ("lora_name", "cache_namespace", "is_eagle", "block_mm_infos"):
            if option in kwargs and dl.compute_block_hash_for_seq(
                    tokens, block, **{k: v for k, v in kwargs.items() if k != option}) != want:
                exercised[option] = exercised.get(option, 0) + 1
        if want and want != plain:
            exercised["any"] = exercised.get("any", 0) + 1
    print(f"{CASES} cases by kind: {kinds}; hashes changed by each option: {exercised}")
    assert sum(kinds.values()) == CASES >= 1000
    assert min(kinds.values()) >= CASES // 10, kinds
    # Each option changed the hashes (against the same case without it) in many cases.
    for option in ("lora_name", "cache_namespace", "is_eagle", "block_mm_infos"):
        assert exercised.get(option, 0) >= CASES // 20, (option, exercised)


def test_block_hash_errors_agree():
    for args, exc in [(([1, 2], 0), ValueError), (([1, -1], 1), OverflowError), (([1 << 32], 1), OverflowError)]:
        with pytest.raises(exc):
            dl.compute_block_hash_for_seq(*args)
        with pytest.raises(exc):
            kd.compute_block_hash_for_seq(*args)
    bad = [None, {"nope": 1}]
    with pytest.raises(Exception):
        dl.compute_block_hash_for_seq(list(range(8)), 4, bad)
    with pytest.raises(Exception):
        kd.compute_block_hash_for_seq(list(range(8)), 4, bad)


# ---- RadixTree


class Fleet:
    """A random prefix tree of blocks and workers' ranks storing and evicting paths of it, as
    engines publish them: each rank's engine hashes are its own, and a rank evicts a block only
    after the blocks it holds after it (the deepest first, as vLLM's prefix cache frees a
    sequence's blocks in reverse order). Evicting a parent while keeping its child is where the
    two indexes' rules differ (test_where_the_rules_differ)."""

    def __init__(self, rng: random.Random, workers: int, ranks: int, nodes: int = 120) -> None:
        self.rng = rng
        self.parent: List[Optional[int]] = []
        self.local: List[int] = []
        for n in range(nodes):
            p = None if n < 4 or rng.random() < 0.05 else rng.randrange(max(0, n - 20), n)
            self.parent.append(p)
            self.local.append(mix(n, 7) if rng.random() < 0.97 else mix(rng.randrange(3), 99))
        self.children: Dict[int, List[int]] = {}
        for n, p in enumerate(self.parent):
            if p is not None:
                self.children.setdefault(p, []).append(n)
        self.ranks = [(w, r) for w in range(1, workers + 1) for r in range(ranks)]
        self.held: Dict[Tuple[int, int], set] = {k: set() for k in self.ranks}
        self.published: Dict[Tuple[int, int], int] = {}  # events per (worker, rank)

    def path(self, node: int) -> List[int]:
        out = []
        while node is not None:
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    def engine(self, w: int, r: int, node: int) -> int:
        # Engines of one model hash a block alike (vLLM with a fixed hash seed): every rank
        # publishes the same engine hash for a block, as Dynamo's tree expects (its edges keep
        # the first publisher's engine hashes; see test_where_the_rules_differ).
        return mix(node, 3)

    def queries(self) -> List[List[int]]:
        out = []
        for n in range(0, len(self.local), 3):
            p = [self.local[x] for x in self.path(n)]
            out.append(p)
            out.append(p + [mix(n, 5)])
        out.append([mix(1, 2, 3)])
        return out

    def event(self, event_id: int) -> Tuple[str, int, bytes]:
        rng = self.rng
        w, r = rng.choice(self.ranks)
        self.published[(w, r)] = self.published.get((w, r), 0) + 1
        held = self.held[(w, r)]
        roll = rng.random()
        if roll < 0.6 or not held:
            full = self.path(rng.randrange(len(self.local)))
            k = 0
            while k < len(full) and full[k] in held and rng.random() < 0.9:
                k += 1
            blocks = full[k:k + rng.randrange(1, 6)]
            if not blocks:
                blocks = full[-1:]
                k = len(full) - 1
            parent = self.engine(w, r, full[k - 1]) if k > 0 else None
            if rng.random() < 0.03:
                parent = mix(rng.randrange(1000), 42)  # unknown parent
            held.update(blocks)
            data = {"stored": {"parent_hash": parent,
                               "blocks": [{"block_hash": self.engine(w, r, b), "tokens_hash": self.local[b]}
                                          for b in blocks]}}
            kind = "stored"
        elif roll < 0.9:
            gone = []
            for _ in range(rng.randrange(1, 4)):
                leaves = sorted(b for b in held if b not in gone and not any(
                    c in held and c not in gone for c in self.children.get(b, ())))
                if not leaves:
                    break
                gone.append(rng.choice(leaves))
            hashes = [self.engine(w, r, b) for b in gone]
            if rng.random() < 0.05:
                hashes.append(mix(rng.randrange(1000), 43))  # an unknown block
            held.difference_update(gone)
            data = {"removed": {"block_hashes": hashes}}
            kind = "removed"
        else:
            held.clear()
            data = "cleared"
            kind = "cleared"
        event = {"event_id": event_id, "data": data}
        if r or rng.random() < 0.5:
            event["dp_rank"] = r
        return kind, w, json.dumps(event).encode()


def apply_both(ours: kd.RadixTree, theirs, worker: int, data: bytes) -> None:
    outcome = []
    for tree in (theirs, ours):
        try:
            tree.apply_event(worker, data)
            outcome.append(None)
        except Exception as e:  # both sides must fail alike
            outcome.append(type(e))
    assert outcome[0] == outcome[1], (data, outcome)


def assert_same_matches(ours, theirs, queries, context="") -> None:
    for q in queries:
        want = theirs.find_matches(q).scores
        got = ours.find_matches(q).scores
        assert got == want, f"{context}: query of {len(q)} blocks: kvrouter {got}, Dynamo {want}"


@pytest.mark.parametrize("seed, workers, ranks", [(1, 1, 1), (2, 3, 1), (3, 4, 2), (4, 6, 3), (5, 2, 2)])
def test_radix_tree_agrees_on_random_event_streams(seed, workers, ranks):
    rng = random.Random(seed)
    fleet = Fleet(rng, workers, ranks)
    ours, theirs = kd.RadixTree(), dl.RadixTree()
    queries = fleet.queries()
    kinds: Dict[str, int] = {}
    for i in range(600):
        kind, worker, data = fleet.event(i)
        kinds[kind] = kinds.get(kind, 0) + 1
        apply_both(ours, theirs, worker, data)
        if i % 50 == 49:
            assert_same_matches(ours, theirs, queries, f"after event {i}")
        if i == 300:
            w = rng.randrange(1, workers + 1)
            ours.remove_worker(w)
            theirs.remove_worker(w)
            for r in range(ranks):
                fleet.held[(w, r)].clear()
        if i == 450:
            w = rng.randrange(1, workers + 1)
            ours.clear_all_blocks(w)
            theirs.clear_all_blocks(w)
            for r in range(ranks):
                fleet.held[(w, r)].clear()
    assert_same_matches(ours, theirs, queries, "at the end")
    assert kinds.get("stored") and kinds.get("removed") and kinds.get("cleared")
    assert len(fleet.published) == workers * ranks  # every worker and rank published

    # Each side's dump, replayed into a fresh tree of either kind, gives the same matches.
    for dump in (ours.dump_tree_as_events(), theirs.dump_tree_as_events()):
        fresh_ours, fresh_theirs = kd.RadixTree(), dl.RadixTree()
        for line in dump:
            router_event = json.loads(line)
            data = json.dumps(router_event["event"]).encode()
            apply_both(fresh_ours, fresh_theirs, router_event["worker_id"], data)
        assert_same_matches(fresh_ours, theirs, queries, "dump replayed into kvrouter")
        assert_same_matches(fresh_theirs, theirs, queries, "dump replayed into Dynamo")


def test_early_exit_is_the_full_match():
    rng = random.Random(9)
    fleet = Fleet(rng, 4, 1)
    ours, theirs = kd.RadixTree(), dl.RadixTree()
    for i in range(300):
        _, worker, data = fleet.event(i)
        apply_both(ours, theirs, worker, data)
    fewer = 0
    for q in fleet.queries():
        full = theirs.find_matches(q).scores
        early = theirs.find_matches(q, early_exit=True).scores
        assert ours.find_matches(q, early_exit=True).scores == full
        # Dynamo stops counting once one worker is left: only that worker's score can be lower.
        assert early.keys() == full.keys()
        lower = [k for k in full if early[k] != full[k]]
        assert len(lower) <= 1 and all(early[k] < full[k] for k in lower)
        fewer += bool(lower)
    print(f"early_exit: Dynamo's score is lower for one worker in {fewer} queries")


def test_dump_format_is_dynamos():
    ours, theirs = kd.RadixTree(), dl.RadixTree()
    ev = json.dumps({"event_id": 5, "dp_rank": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 10, "tokens_hash": 100}, {"block_hash": 11, "tokens_hash": 101}]}}}).encode()
    apply_both(ours, theirs, 7, ev)
    (a,), (b,) = ours.dump_tree_as_events(), theirs.dump_tree_as_events()
    assert json.loads(a) == json.loads(b)


def test_errors_agree():
    ours, theirs = kd.RadixTree(), dl.RadixTree()
    for bad in [b"not json", b"[1]", b'{"event_id": 1}', b'{"data": "cleared"}', b'{"event_id": 1, "data": "x"}',
                b'{"event_id": -1, "data": "cleared"}',
                b'{"event_id": 1, "data": {"stored": {"parent_hash": 5, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}}',
                b'{"event_id": 1, "data": {"removed": {"block_hashes": [77]}}}',
                b'{"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": -1, "tokens_hash": 2}]}}}']:
        apply_both(ours, theirs, 1, bad)
    for tree in (ours, theirs):
        with pytest.raises(OverflowError):
            tree.find_matches([-1])
        with pytest.raises(OverflowError):
            tree.apply_event(-1, b'{"event_id": 1, "data": "cleared"}')
        assert tree.find_matches([]).scores == {}
        assert tree.find_matches([1, 2]).frequencies == []


def test_where_the_rules_differ():
    """The documented differences in indexing. (1) A stored event repeating a block hash: Dynamo
    indexes it whole, kvrouter cuts it at the repetition. (2) A rank evicting a block but keeping
    the blocks after it: Dynamo 1.6.1 (its path-compressed tree) drops the rank's hold on the rest
    of the tree edge too, so a later removal of a kept block is "not found" there; kvrouter keeps
    them (no cascade), invisible to matches until the evicted block is stored again. (3) Ranks
    publishing different engine hashes for the same blocks: Dynamo's edges keep the first
    publisher's, and a later rank's removal of its own blocks there is "not found" (its blocks
    stay); kvrouter keeps every rank's engine hashes and removes them."""
    ours, theirs = kd.RadixTree(), dl.RadixTree()
    chain = json.dumps({"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 10 + i, "tokens_hash": 100 + i} for i in range(3)]}}}).encode()
    apply_both(ours, theirs, 1, chain)
    apply_both(ours, theirs, 1, b'{"event_id": 2, "data": {"removed": {"block_hashes": [10]}}}')
    assert ours.find_matches([100, 101, 102]).scores == theirs.find_matches([100, 101, 102]).scores == {}
    again = b'{"event_id": 3, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 10, "tokens_hash": 100}]}}}'
    apply_both(ours, theirs, 1, again)
    assert theirs.find_matches([100, 101, 102]).scores == {(1, 0): 1}
    assert ours.find_matches([100, 101, 102]).scores == {(1, 0): 3}

    ours, theirs = kd.RadixTree(), dl.RadixTree()
    for worker, base in ((2, 20), (3, 30)):
        ev = json.dumps({"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": base + i, "tokens_hash": 100 + i} for i in range(3)]}}}).encode()
        apply_both(ours, theirs, worker, ev)
    remove = b'{"event_id": 2, "data": {"removed": {"block_hashes": [32]}}}'
    with pytest.raises(RuntimeError, match="Failed to find block"):
        theirs.apply_event(3, remove)
    ours.apply_event(3, remove)
    assert theirs.find_matches([100, 101, 102]).scores == {(2, 0): 3, (3, 0): 3}
    assert ours.find_matches([100, 101, 102]).scores == {(2, 0): 3, (3, 0): 2}

    ours, theirs = kd.RadixTree(), dl.RadixTree()
    ev = json.dumps({"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 20, "tokens_hash": 100}, {"block_hash": 20, "tokens_hash": 101}]}}}).encode()
    theirs.apply_event(1, ev)
    with pytest.raises(RuntimeError, match="repeats"):
        ours.apply_event(1, ev)
    assert theirs.find_matches([100, 101]).scores == {(1, 0): 2}
    assert ours.find_matches([100, 101]).scores == {(1, 0): 1}
