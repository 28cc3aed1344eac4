"""Reasoning items in a turn's history: the Responses API's record of a round's reasoning,
kept on the assistant message it came with (`REASONING_ITEMS`), sent back to that API,
dropped for Chat Completions, and shown to clients without the provider's sealed
`encrypted_content`.
"""

from __future__ import annotations

from typing import Any

REASONING_ITEMS = "reasoning_items"
"""The key of an assistant message in history that holds its Responses reasoning items."""


def without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as Chat Completions takes it: the Responses reasoning items dropped."""
    return [
        {k: v for k, v in m.items() if k != REASONING_ITEMS} if REASONING_ITEMS in m else m
        for m in messages
    ]


def public_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as a client reads it: reasoning items keep their summaries, never
    their `encrypted_content` (the provider's sealed reasoning, for agentq to send back)."""
    return [
        {
            **m,
            REASONING_ITEMS: [
                {k: v for k, v in item.items() if k != "encrypted_content"}
                for item in m[REASONING_ITEMS]
            ],
        }
        if REASONING_ITEMS in m
        else m
        for m in messages
    ]
