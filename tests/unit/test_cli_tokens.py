"""Tokens are URL-safe base64: one in 64 begins with "-", and the CLI must still read it."""

from __future__ import annotations

import pytest

from agentq.cli.main import _glued, build_parser


@pytest.mark.parametrize(
    "argv",
    [
        ["waitpoint", "complete", "wp_x", "--token", "-Ab_9", "--json", "1"],
        ["abort", "0123abcd", "--token", "-Ab_9"],
        ["answer", "0123abcd", "r1", "approve", "--token", "-Ab_9"],
    ],
)
def test_a_token_that_begins_with_a_dash_is_read_as_the_value(argv: list[str]) -> None:
    args, rest = build_parser().parse_known_args(_glued(argv))
    assert args.token == "-Ab_9" and rest == []


def test_words_after_a_double_dash_are_left_alone() -> None:
    assert _glued(["run", "--", "--token", "-x"]) == ["run", "--", "--token", "-x"]
    assert _glued(["abort", "t", "--token"]) == ["abort", "t", "--token"]
