"""What the driver receives every step: named numbers as float32 buffers, decoded back to what was sent."""

import numpy as np
import pytest

from rlfabric.actors.llm_learner_metrics import LEARNER_METRICS
from rlfabric.actors.rollout_meta import decode_meta, encode_meta
from rlfabric.compact import FloatFields, payload_bytes


def test_fields_round_trip_and_leave_out_what_was_not_sent():
    fields = FloatFields("a", "b", "c")
    data = fields.pack({"a": 1.5, "c": -2.0})
    assert len(data) == 1 + 12  # one byte of presence bits, three float32 values
    assert fields.unpack(data) == {"a": 1.5, "c": -2.0}


def test_a_nan_metric_reaches_the_driver_as_nan():
    back = LEARNER_METRICS.unpack(LEARNER_METRICS.pack({"pg_loss": float("nan"), "grad_norm": 2.0}))
    assert set(back) == {"pg_loss", "grad_norm"} and np.isnan(back["pg_loss"]) and back["grad_norm"] == 2.0


def test_an_unlisted_name_is_an_error_not_a_silent_loss():
    with pytest.raises(ValueError, match=r"\['kl_new'\] are not among the fields"):
        LEARNER_METRICS.pack({"pg_loss": 0.1, "kl_new": 0.2})


def test_rollout_metadata_round_trips_with_counts_as_ints_and_rare_parts_kept():
    stats = np.array([[7, 0.5, 1, 8, 3], [8, 0.0, 0, 8, 3]], np.float32)
    meta = {
        "samples": 16,
        "rows": 15,
        "failed": 1,
        "tokens": 301,
        "record_bytes": 12345,
        "reward_restarts": 0,
        "response_length_mean": 4.25,
        "generate_time_s": 0.5,
        "reward_time_s": 0.25,
        "group_stats": stats,
        "component_means": {"correct": 0.5, "format": 0.75},
        "errors": ["ValueError: bad"],
    }
    back = decode_meta(encode_meta(meta))
    np.testing.assert_array_equal(back.pop("group_stats"), stats)
    expected = {k: v for k, v in meta.items() if k != "group_stats"}
    assert back == expected
    assert all(type(back[k]) is int for k in ("samples", "rows", "failed", "tokens", "record_bytes"))


def test_a_step_of_metadata_is_a_few_hundred_bytes():
    # The benchmark's rollout: 8 groups, two reward components; and one learner's full metrics.
    meta = {
        "samples": 64,
        "rows": 64,
        "failed": 0,
        "tokens": 2048,
        "record_bytes": 47616,
        "reward_restarts": 0,
        "response_length_mean": 32.0,
        "generate_time_s": 0.3,
        "reward_time_s": 0.01,
        "group_stats": np.zeros((8, 5), np.float32),
        "component_means": {"correct": 0.1, "format": 0.2},
    }
    metrics = {name: 1.0 for name in LEARNER_METRICS.names}  # every one, step credit's two included
    # 420 bytes before outside agents' four counts joined the numbers (their presence bits cost one more byte);
    # the record it describes is 47,616 bytes
    assert payload_bytes(encode_meta(meta)) + payload_bytes(LEARNER_METRICS.pack(metrics)) < 430
