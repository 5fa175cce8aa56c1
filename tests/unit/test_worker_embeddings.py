"""The reference worker's embeddings (hashed bags of tokens) and the parsing of their requests."""

from __future__ import annotations

import base64
import math
import struct

import pytest

from worker.embeddings import as_base64, embed
from worker.errors import ApiError
from worker.parsing import check_model, parse_embedding


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_vectors_are_unit_length_deterministic_and_sized() -> None:
    for dims in (1, 8, 256, 1000):
        vec = embed([5, 17, 17, 99], dims)
        assert len(vec) == dims
        assert math.isclose(math.sqrt(sum(x * x for x in vec)), 1.0, rel_tol=1e-9)
        assert embed([5, 17, 17, 99], dims) == vec
    with pytest.raises(ValueError, match="dimensions"):
        embed([1], 0)


def test_shared_tokens_point_the_same_way_and_order_counts() -> None:
    base = list(range(100, 140))
    near = base[:30] + list(range(500, 510))
    far = list(range(900, 940))
    assert _cosine(embed(base, 256), embed(near, 256)) > 0.5
    assert abs(_cosine(embed(base, 256), embed(far, 256))) < 0.3
    # Neighbouring pairs are features too: the same tokens in another order differ.
    assert embed(base, 256) != embed(base[::-1], 256)


def test_base64_is_little_endian_float32() -> None:
    vec = embed([1, 2, 3], 16)
    raw = base64.b64decode(as_base64(vec))
    assert len(raw) == 16 * 4
    assert list(struct.unpack("<16f", raw)) == pytest.approx(vec, abs=1e-7)


def test_parse_embedding_takes_the_openai_shapes() -> None:
    params = parse_embedding({"model": "m", "input": ["a", "b"], "encoding_format": "base64",
                              "dimensions": 32}, "m", 256, 4096)
    assert params.inputs == ("a", "b")
    assert params.dimensions == 32
    assert params.base64
    assert parse_embedding({"input": [1, 2]}, "m", 256, 4096).inputs == ((1, 2),)
    assert parse_embedding({"input": [[1], [2, 3]]}, "m", 256, 4096).dimensions == 256


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": None}, 400, "input"),
    ({"input": [1, "a"]}, 400, "input"),
    ({"input": [-1]}, 400, "input"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"input": "a", "dimensions": 5000}, 400, "dimensions"),
    ({"input": "a", "dimensions": True}, 400, "dimensions"),
    ({"input": "a", "cache_salt": 1}, 400, "cache_salt"),
    ({"input": "a", "model": "other"}, 404, "model"),
    ({"input": "a", "model": 3}, 400, "model"),
])
def test_parse_embedding_refuses_what_it_cannot_serve(
        body: dict[str, object], status: int, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_embedding(body, "m", 256, 4096)
    assert caught.value.status == status
    assert caught.value.param == param


def test_model_may_be_left_out() -> None:
    check_model({}, "m")
    check_model({"model": "m"}, "m")
    with pytest.raises(ApiError):
        check_model({"model": "n"}, "m")
