"""One definition per sample kind: the structs that parse a sample also give the learn
tool its JSON Schema and the log its canonical bytes."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from shared.samples import (
    Example,
    Feedback,
    SampleError,
    learn_input_schema,
    load_stored,
    parse_batch,
    parse_sample,
)

GOOD: list[dict[str, Any]] = [
    {"input": "q", "target": "a"},
    {"kind": "example", "input": "", "target": "a", "context_id": "c1", "version": 1, "modalities": ["text"]},
    {"generation_id": "g", "input": "q", "corrected": "a"},
    {"kind": "feedback", "generation_id": "g", "input": "q", "output": "o", "preference": "up"},
]
# Refused by the schema as well as by the structs (rules that tie fields together, blank
# strings and the configured limits are the structs' and the caller's alone).
BAD: list[dict[str, Any]] = [
    {"input": "q", "target": ""},
    {"input": "q"},
    {"input": "q", "target": 3},
    {"input": "q", "target": "a", "weight": 2},
    {"kind": "dream", "input": "q", "target": "a"},
    {"input": "q", "target": "a", "context_id": "c1", "version": -1},
    {"input": "q", "target": "a", "context_id": "c1", "version": 0},  # versions start at 1
    {"input": "q", "target": "a", "context_id": "../c1", "version": 1},  # not a context id
    {"input": "q", "target": "a", "context_id": "c" * 129, "version": 1},
    {"kind": "feedback", "generation_id": "g", "input": "q", "preference": "meh"},
    {"kind": "feedback", "generation_id": "g", "input": "q", "target": "a"},
    {"kind": "example", "generation_id": "g", "input": "q", "target": "a"},
    {"generation_id": "x" * 257, "input": "q", "corrected": "a"},
]


@pytest.fixture(scope="module")
def schema() -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for(learn_input_schema())


@pytest.mark.parametrize("obj", GOOD)
def test_the_learn_schema_accepts_what_the_structs_accept(schema: jsonschema_rs.Validator,
                                                          obj: dict[str, Any]) -> None:
    parse_sample(obj, max_bytes=4096)
    assert schema.is_valid(obj) and schema.is_valid({"samples": [obj, obj]})


@pytest.mark.parametrize("obj", BAD)
def test_the_learn_schema_refuses_what_the_structs_refuse(schema: jsonschema_rs.Validator,
                                                          obj: dict[str, Any]) -> None:
    with pytest.raises(SampleError):
        parse_sample(obj, max_bytes=4096)
    assert not schema.is_valid(obj) and not schema.is_valid({"samples": [GOOD[0], obj]})


def test_a_batch_is_not_mixed_with_a_sample_and_is_never_empty(schema: jsonschema_rs.Validator) -> None:
    assert not schema.is_valid({"samples": []})
    assert not schema.is_valid({"samples": [GOOD[0]], "input": "q"})


@pytest.mark.parametrize("obj, message", [
    ({"input": "q", "target": "   "}, "'target' must not be blank"),
    ({"input": "q", "target": ""}, "$.target"),
    ({"input": "q", "target": "a", "weight": 2}, "weight"),
    ({"input": "q", "target": "a", "version": 1}, "'version' needs 'context_id'"),
    ({"generation_id": "g", "input": "q"}, "feedback needs 'corrected' or 'preference'"),
    ({"generation_id": "g", "input": "q", "preference": "up"}, "an up-vote needs the generated 'output'"),
    ({"input": "q", "target": "a", "context_id": "c", "version": 1, "modalities": ["smell"]},
     "unknown modality: smell"),
    ({"input": "q", "target": "a", "context_id": "c", "version": 1, "modalities": []},
     "'modalities' must not be empty"),
    ({"input": "q", "target": "a", "context_id": "c", "version": 1, "modalities": ["text", "image", "text"]},
     "duplicate modality in 'modalities': text"),
])
def test_refusals_name_the_field(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(SampleError, match=message.replace("$", r"\$")):
        parse_sample(obj, max_bytes=4096, modalities=["text"])


def test_the_log_still_reads_a_sample_with_a_modality_twice() -> None:
    """Refused on the way in, but one already in the log is trained, not skipped with its entry."""
    stored = load_stored(b'{"kind":"example","input":"q","target":"a","context_id":"c","version":1,'
                         b'"modalities":["text","text"]}')
    assert stored.modalities == ["text", "text"]


def test_a_bad_sample_in_a_batch_is_named_by_its_index() -> None:
    with pytest.raises(SampleError) as err:
        parse_batch([GOOD[0], {"input": "q", "target": ""}], max_bytes=4096, max_count=8)
    assert err.value.index == 1 and str(err.value).startswith("sample 1: ")


def test_the_canonical_json_leaves_out_what_is_unset_and_reads_back_equal() -> None:
    example = parse_sample({"input": "q", "target": "a"}, max_bytes=4096)
    assert example == Example(input="q", target="a")
    assert example.to_json() == b'{"kind":"example","input":"q","target":"a"}'
    feedback = parse_sample(GOOD[3], max_bytes=4096)
    assert isinstance(feedback, Feedback) and load_stored(feedback.to_json()) == feedback
    assert feedback.to_dict() == GOOD[3]
