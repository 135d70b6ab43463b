"""Envelopes round-trip, and anything else is rejected with a reason for the dead-letter topic."""

from __future__ import annotations

import base64

import pytest

from common.bus import Record
from common.messages import BadMessage, DeadLetter, Envelope, decode


def test_envelope_round_trip():
    sent = Envelope(type="prefill", job_id="job-1", seq=3, payload={"prompt_token_ids": [1, 2, 3]})
    assert decode(sent.encode(), expected_type="prefill") == sent


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe not json", "not a deepmesh envelope"),
        (b"[1, 2]", "not a deepmesh envelope"),
        (b'{"type": "prefill"}', "job_id: Field required"),
        (b'{"type": "prefill", "job_id": "j", "seq": -1}', "seq: Input should be greater than or equal to 0"),
        (b'{"type": "prefill", "job_id": "j", "surprise": 1}', "surprise: Extra inputs are not permitted"),
        (b'{"type": "prefill", "job_id": "j", "version": 99}', "version 99 is not supported"),
        (b'{"type": "tokens", "job_id": "j"}', "does not belong on this topic"),
    ],
)
def test_bad_records_are_rejected_with_a_reason(raw, reason):
    with pytest.raises(BadMessage, match=reason):
        decode(raw, expected_type="prefill")


def test_dead_letter_keeps_the_original_bytes():
    record = Record("deepmesh.prefill", 2, 41, "job-9", b"\x00garbage", {})
    letter = DeadLetter.of(record, "not a deepmesh envelope", "prefill-workers")
    assert base64.b64decode(letter.value_base64) == b"\x00garbage"
    assert DeadLetter.model_validate_json(letter.model_dump_json()) == letter
