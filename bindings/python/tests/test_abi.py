"""The extension against the header: struct tables, sizes, enumerations, the version check,
and every option reaching its own C field."""

from __future__ import annotations

import math
import os

import pytest

import kvrouter
from kvrouter import _abi, _native
from kvrouter._options import _JetStreamSource


def test_struct_tables_match_the_generated_layouts():
    compiled = _native.abi()["structs"]
    assert set(compiled) == set(_abi.STRUCTS)
    for name, (size, fields) in _abi.STRUCTS.items():
        assert compiled[name] == (size, fields), name


def test_enumerations_and_constants_match():
    abi = _native.abi()
    assert abi["version"] == _abi.ABI_VERSION
    for typedef, cls in _abi.ENUMERATIONS:
        assert abi["enumerations"][typedef] == {v.name: int(v) for v in cls}
        assert all(v.description for v in cls)
    assert abi["constants"] == _abi.CONSTANTS
    assert kvrouter.Status.NOT_FOUND.description.startswith("an unknown worker")


def test_every_versioned_struct_initialises_with_its_compiled_size():
    for name, (size, fields) in _abi.STRUCTS.items():
        if fields[0][0] != "struct_size":
            continue
        defaults = _native.defaults(name)  # raises if _init refused the size
        value_fields = {f for f, _, _ in fields if f != "struct_size" and not f.startswith("reserved")}
        assert set(defaults) <= value_fields


def test_the_library_is_the_one_in_the_package():
    assert kvrouter.version() // 100 == 2  # 0.2.x
    assert kvrouter.version_string().startswith("0.2.")
    assert kvrouter.__version__ == kvrouter.version_string()
    here = os.path.dirname(kvrouter.__file__)
    with open(f"/proc/{os.getpid()}/maps") as maps:
        libs = {line.split()[-1] for line in maps if "libkvrouter.so" in line}
    assert libs and all(os.path.dirname(p) == here or "kvrouter.libs" in p for p in libs), libs


def test_a_repaired_wheel_loads_its_own_dependencies():
    bundled = os.path.join(os.path.dirname(os.path.dirname(kvrouter.__file__)), "kvrouter.libs")
    if not os.path.isdir(bundled):
        pytest.skip("not an auditwheel-repaired install (no kvrouter.libs)")
    with open(f"/proc/{os.getpid()}/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/lib" in line}
    deps = [p for p in paths if any(n in os.path.basename(p) for n in ("libabsl", "libuv", "libzmq", "libnats"))]
    assert deps, paths
    outside = [p for p in deps if os.path.dirname(p) != bundled]
    assert not outside, f"loaded from the system instead of the wheel: {outside}"


def test_version_check_refuses_another_minor():
    abi = _native.abi()
    kvrouter._check_abi(200, abi)
    kvrouter._check_abi(299, abi)
    for other in (300, 100, 10200):
        with pytest.raises(ImportError, match="accepts 0.2.x only"):
            kvrouter._check_abi(other, abi)
    changed = dict(abi, enumerations=dict(abi["enumerations"], kvr_tier={"DEVICE": 0}))
    with pytest.raises(ImportError, match="different kvrouter.h"):
        kvrouter._check_abi(200, changed)


# Counts set together with their pointers (by the extension, from the arrays' lengths; a
# HashedPrompt's hashes set kvr_request_options.local_hashes per call).
_COUNTS = {"mm_num_blocks", "num_allowed_worker_ids", "num_blocks", "num_tokens", "num_local_hashes"}


def _value_fields(struct: str) -> set:
    names = [f for f, _, _ in _abi.STRUCTS[struct][1]]
    settable = set(_native.defaults(struct))  # value fields: not pointers, struct_size, reserved
    return {f for f in names if f in settable and f not in _COUNTS}


@pytest.mark.parametrize(
    "struct, options",
    [
        ("kvr_router_options", kvrouter.RouterOptions(
            block_size=32, approximate=True, assume_kv_reuse=False, track_prefill_tokens=False, eagle=True,
            entropy_seed=True, track_output_blocks=True, queue_policy=kvrouter.QueuePolicy.WSPT,
            overlap_score_credit=0.5, prefill_load_scale=2.5, host_cache_hit_weight=0.6,
            disk_cache_hit_weight=0.1, temperature=0.3, queue_threshold=1.5, approx_ttl_seconds=9.0,
            approx_max_blocks=99, approx_prune_target_ratio=0.7, request_expiry_seconds=33.0,
            random_seed=5, overlap_score_credit_decay=0.2, decode_active_request_weight=0.4, index_shards=4,
            cost_function=kvrouter.CostFunction.PREDICTED_TTFT, prefill_tokens_per_second=5000.0,
            ttft_miss_weight=0.5)),
        ("kvr_worker_config", kvrouter.WorkerConfig(7, block_size=32, dp_start=2, dp_size=3,
                                                    total_kv_blocks=1000, max_num_batched_tokens=8192)),
        ("kvr_request_options", kvrouter.RequestOptions(
            admit=True, overlap_score_credit=0.1, prefill_load_scale=0.2, host_cache_hit_weight=0.3,
            disk_cache_hit_weight=0.4, temperature=0.5, assume_kv_reuse=False, track_prefill_tokens=True,
            priority_jump=1.5, expected_output_tokens=77, queue_timeout=0.25,
            overlap_score_credit_decay=0.6, decode_active_request_weight=0.7,
            cost_function=kvrouter.CostFunction.PREDICTED_TTFT, ttft_miss_weight=3.5)),
        ("kvr_routing_hints", kvrouter.RoutingHints(
            phase=kvrouter.Phase.DECODE, worker_id=1, prefill_worker_id=2, decode_worker_id=3, dp_rank=1,
            prefill_dp_rank=2, session_mode=kvrouter.SessionMode.SOFT, session_ttl_seconds=12.0)),
        ("kvr_disagg_options", kvrouter.DisaggOptions(
            policy=kvrouter.DisaggPolicy.ISL_OR_LOAD, enforce=True, max_local_prefill_tokens=9,
            max_local_prefill_ratio=0.5, prefill_busy_threshold=0.25, decode_busy_threshold=0.75)),
        ("kvr_ingest_options", kvrouter.IngestOptions(max_frame_bytes=1 << 20, replay_timeout_ms=50,
                                                       replica_heartbeat_ms=250, replica_timeout_ms=2500)),
        ("kvr_engine_worker", kvrouter.EngineWorker("tcp://127.0.0.1:1", 4, engine=kvrouter.Engine.SGLANG,
                                                    dp_start=1, dp_size=2, block_size=32, eagle=True)),
        # Ingest.subscribe_jetstream's keyword arguments.
        ("kvr_jetstream_source", _JetStreamSource(start_sequence=7, resume=True, create_stream=True,
                                                  max_age_seconds=90.0, max_bytes=1 << 20)),
    ],
)
def test_every_option_reaches_its_own_c_field(struct, options):
    fields = options._fields()
    # Every value field of the C struct is set by the Python type (pointers are set apart) ...
    missing = _value_fields(struct) - set(fields)
    assert not missing, f"{type(options).__name__} never sets {sorted(missing)}"
    # ... and every one of them differs from the library's default, so each is really lowered.
    lowered = _native.lower(struct, fields)
    defaults = _native.defaults(struct)
    same = [f for f in fields if lowered[f] == defaults[f] or (
        isinstance(defaults[f], float) and math.isnan(defaults[f]) and math.isnan(lowered[f]))]
    assert not same, f"{type(options).__name__}: fields left at the default {same}"


@pytest.mark.parametrize(
    "struct, event",
    [
        # Lowered only, never applied (a sliding-window store with a parent is refused).
        ("kvr_stored_event", kvrouter.StoredEvent(
            worker_id=3, block_hashes=[1], dp_rank=1, event_id=9, tier=kvrouter.Tier.HOST_PINNED,
            parent_hash=5, eagle=True, sliding_group=2, sliding_window_tokens=32)),
        ("kvr_removed_event", kvrouter.RemovedEvent(
            worker_id=3, block_hashes=[1], dp_rank=1, event_id=9, tier=kvrouter.Tier.DISK, sliding_group=2)),
    ],
)
def test_every_event_field_reaches_its_own_c_field(struct, event):
    fields = event._args()[0]
    missing = _value_fields(struct) - set(fields)
    assert not missing, f"{type(event).__name__} never sets {sorted(missing)}"
    lowered = _native.lower(struct, fields)
    defaults = _native.defaults(struct)
    same = [f for f in fields if lowered[f] == defaults[f]]
    assert not same, f"{type(event).__name__}: fields left at the default {same}"


def test_defaults_are_the_librarys():
    lowered = _native.lower("kvr_router_options", kvrouter.RouterOptions()._fields())
    assert lowered == _native.defaults("kvr_router_options")
    lowered = _native.lower("kvr_request_options", kvrouter.RequestOptions()._fields())
    defaults = _native.defaults("kvr_request_options")
    for k, v in defaults.items():
        assert lowered[k] == v or (math.isnan(v) and math.isnan(lowered[k])), k


def test_unknown_field_and_out_of_range_values_are_refused():
    with pytest.raises(TypeError, match="no settable field"):
        _native.lower("kvr_worker_config", {"nope": 1})
    with pytest.raises(TypeError, match="no settable field"):
        _native.lower("kvr_worker_config", {"struct_size": 1})
    with pytest.raises(OverflowError):
        _native.lower("kvr_worker_config", {"dp_size": 1 << 32})
    with pytest.raises(OverflowError):
        _native.lower("kvr_worker_config", {"worker_id": -1})


def test_result_types_are_the_generated_stubs():
    import ast
    import kvrouter._native as native

    stub_path = os.path.join(os.path.dirname(kvrouter.__file__), "_native.pyi")
    with open(stub_path) as f:
        tree = ast.parse(f.read())
    # The result types are the stub's Tuple subclasses.
    results = {node.name: [fn.name for fn in node.body if isinstance(fn, ast.FunctionDef)]
               for node in tree.body if isinstance(node, ast.ClassDef) and node.bases
               and ast.unparse(node.bases[0]).startswith("Tuple")}
    assert len(results) == 9
    for name, fields in results.items():
        assert list(getattr(native, name).__match_args__) == fields, name
