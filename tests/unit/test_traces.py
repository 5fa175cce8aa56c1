"""The trace reader (Mooncake jsonl) and the synthetic trace generator."""

from __future__ import annotations

import hashlib
import itertools
import re
from pathlib import Path

import pytest

from gateway.fingerprint import FingerprintOptions
from loadtest.traces import (
    BLOCK_TOKENS,
    DEFAULT_TRACE_DIR,
    SyntheticSpec,
    TraceFormatError,
    mix_block_id,
    read_mooncake,
    synthetic_trace,
    to_mooncake_lines,
)

LINES = [
    '{"timestamp": 0, "input_length": 2100, "output_length": 7, "hash_ids": [0, 1, 2, 3, 4]}',
    "",
    '{"timestamp": 1500, "input_length": 900, "output_length": 3, "hash_ids": [0, 5]}',
    '{"timestamp": 1500, "input_length": 2600, "output_length": 1, '
    '"hash_ids": [0, 1, 2, 3, 4, 6]}',
]


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_mooncake_lines(tmp_path: Path) -> None:
    reqs = read_mooncake(write(tmp_path, LINES))
    assert [r.index for r in reqs] == [0, 1, 2]
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 1.5]
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(2100, 7), (900, 3), (2600, 1)]
    assert reqs[0].cost_tokens == 2107
    assert reqs[0].blocks == tuple(mix_block_id(i) for i in (0, 1, 2, 3, 4))


def test_block_hashes_share_prefixes_and_anchor_is_fourth_block(tmp_path: Path) -> None:
    a, short, c = read_mooncake(write(tmp_path, LINES))
    # Equal ids at the same position: equal hashes; different ids: different hashes.
    assert a.blocks == c.blocks[:5]
    assert a.blocks[0] == short.blocks[0]
    assert short.blocks[1] not in a.blocks
    assert all(0 <= h < 2**63 for h in a.blocks)  # usable as PrefixCache token ids
    assert FingerprintOptions().anchor_blocks == 4
    assert a.key.anchor == a.blocks[3] == c.key.anchor
    assert short.key.anchor == short.blocks[-1]  # shorter than the anchor: its last block


def test_limit_and_deterministic(tmp_path: Path) -> None:
    path = write(tmp_path, LINES)
    assert len(read_mooncake(path, limit=2)) == 2
    assert read_mooncake(path) == read_mooncake(path)


def test_unsorted_lines_are_sorted_by_time(tmp_path: Path) -> None:
    reqs = read_mooncake(write(tmp_path, [LINES[2], LINES[0]]))
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert [r.index for r in reqs] == [0, 1]


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, "x"]}',
        '{"timestamp": 0, "input_length": 1, "output_length": 1}',
    ],
)
def test_bad_lines_are_reported_with_their_line_number(tmp_path: Path, line: str) -> None:
    with pytest.raises(TraceFormatError, match=r"trace\.jsonl:2"):
        read_mooncake(write(tmp_path, [LINES[0], line]))


def test_round_trip_through_jsonl(tmp_path: Path) -> None:
    rows = [(0.0, 1000, 5, [7, 8]), (0.25, 600, 2, [7, 9])]
    path = write(tmp_path, list(to_mooncake_lines(rows)))
    reqs = read_mooncake(path)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25]
    assert reqs[0].blocks[0] == reqs[1].blocks[0] == mix_block_id(7)


def test_synthetic_trace_is_deterministic_and_prefix_shaped() -> None:
    spec = SyntheticSpec(requests=300, tenants=4, system_blocks=3, seed=7)
    reqs = synthetic_trace(spec)
    assert reqs == synthetic_trace(spec)
    assert reqs != synthetic_trace(SyntheticSpec(requests=300, tenants=4, system_blocks=3, seed=8))
    assert len(reqs) == 300
    assert all(a.arrival_s < b.arrival_s for a, b in itertools.pairwise(reqs))
    for r in reqs:
        assert -(-r.input_tokens // BLOCK_TOKENS) == len(r.blocks)
        assert r.output_tokens >= 1
    # Four tenants: at most four distinct system prompts (first three blocks).
    assert len({r.blocks[:3] for r in reqs}) <= 4
    # Conversations continue: some prompt extends an earlier one beyond the system prompt.
    seen = {r.blocks for r in reqs}
    assert any(r.blocks[:-3] in seen and len(r.blocks) > 5 for r in reqs)


def test_bundled_traces_match_their_source_note() -> None:
    note = (DEFAULT_TRACE_DIR / "SOURCE.md").read_text(encoding="utf-8")
    for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl"):
        expected = re.search(rf"`{re.escape(name)}`.*?sha256 ([0-9a-f]{{64}})", note)
        assert expected is not None
        digest = hashlib.sha256((DEFAULT_TRACE_DIR / name).read_bytes()).hexdigest()
        assert digest == expected.group(1)
