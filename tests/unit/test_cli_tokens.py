"""Tokens are URL-safe base64: one in 64 begins with "-", and the CLI must still read it."""

from __future__ import annotations

import pytest

from agentq.api import usage_time
from agentq.cli.main import _glued, build_parser
from agentq.cli.replay import cmd_replay


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


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--max-tokens", "0", "x"],
        ["retry", "0123abcd", "--max-tokens", "0"],
        ["fork", "0123abcd", "--at-round", "1", "--max-cost-usd", "-1"],
        ["retry", "--status", "error", "--rate", "0"],
        ["retry", "--status", "error", "--limit", "-5"],
        ["turns", "--watch", "-1"],
        ["turns", "--watch", "0"],
    ],
)
def test_every_command_refuses_a_budget_or_pace_not_above_zero(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The same argparse type for run, retry and fork: refused before any Redis is asked.
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2 and "must be above 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["retry"], ["retry", "0123abcd", "--status", "error"]])
def test_retry_takes_a_turn_id_or_status_exactly(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "turn_id" in err and "--status" in err


@pytest.mark.parametrize("extra", [["--dry-run"], ["--since", "2h"]])
def test_a_single_retry_refuses_the_bulk_options(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before any Redis is asked: a dry run must never start the turn's retry.
    args = build_parser().parse_args(["retry", "0123abcd", *extra])
    assert cmd_replay(None, args) == 2  # type: ignore[arg-type]
    assert "go with --status" in capsys.readouterr().err


def test_usage_takes_utc_days_and_refuses_anything_else() -> None:
    # The command hands its words to Client.usage, which reads them with usage_time.
    args = build_parser().parse_args(["usage", "--since", "2026-01-02", "--until", "2026-01-02"])
    assert (args.since, args.until) == ("2026-01-02", "2026-01-02")
    assert usage_time(args.since, "since") == 1767312000.0
    assert usage_time(args.until, "until", end=True) == 1767312000.0 + 86399
    assert usage_time("1767312000", "since") == 1767312000.0
    for bad, says in (
        ("2026-13-01", "a UTC day"),
        ("1e12", "out of range"),
        ("nan", "out of range"),
    ):
        with pytest.raises(ValueError, match=f"until: {says}"):
            usage_time(bad, "until")


def test_a_bulk_retry_passes_rerun_lost_and_refuses_the_single_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    asked: dict[str, object] = {}

    class Retrier:
        def retry_many(self, **filters: object) -> list[object]:
            asked.update(filters)
            return []

    args = build_parser().parse_args(["retry", "--status", "error", "--rerun-lost", "--json"])
    assert cmd_replay(Retrier(), args) == 0  # type: ignore[arg-type]
    assert asked["rerun_lost"] is True
    # A bulk retry has no budget or model of its own: refused, not ignored.
    args = build_parser().parse_args(["retry", "--status", "error", "--max-tokens", "5"])
    assert cmd_replay(None, args) == 2  # type: ignore[arg-type]
    assert "go with a TURN_ID" in capsys.readouterr().err
