"""Bad input and bad peers cost their own request or connection only: no internal errors for values the protocol
can refuse by name, no token that slips past the check, no idle session kept alive (or another one lost) because
a client stopped reading. These tests need no model."""

from __future__ import annotations

import json

import pytest

from pocketllm.harness.protocol import ProtocolError, parse_line


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_a_seed_past_64_bits_is_refused_by_name(seed: int) -> None:
    """Such a seed used to reach the engine's generator and come back as an internal error."""
    with pytest.raises(ProtocolError) as info:
        parse_line(json.dumps({"op": "generate", "id": 1, "prompt": "x", "seed": seed}))
    assert "seed must fit in 64 bits" in info.value.message and info.value.request_id == 1


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), -1, 0])
def test_every_64_bit_seed_is_taken(seed: int) -> None:
    assert parse_line(json.dumps({"op": "generate", "id": 1, "prompt": "x", "seed": seed})).get("seed") == seed
