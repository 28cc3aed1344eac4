"""`agentq run` in a real terminal (tmux): the approval prompt counts down and takes an answer."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import uuid

import pytest

from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import calls, script

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


def _tmux(session: str, *args: str, check: bool = True) -> str:
    # Each test's session has a tmux server of its own (`-L`): a test's new session never
    # meets the server the test before it is shutting down with its last session.
    out = subprocess.run(
        ["tmux", "-L", session, *args], capture_output=True, text=True, check=check
    )
    return out.stdout


def _screen(session: str) -> str:
    return _tmux(session, "capture-pane", "-p", "-t", session, check=False)


def test_interactive_approval_prompt_counts_down_and_approves(
    fleet, llm_server, agentq_env
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "/tmp/demo"}))),
        Round(text="Deleted as approved."),
    )
    session = f"agentq-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in agentq_env.items())
    cmd = f"env {env} {sys.executable} -m agentq run {shlex.quote(key)}; echo EXIT=$?; sleep 60"
    _tmux(session, "new-session", "-d", "-s", session, "-x", "160", "-y", "40", cmd)
    try:
        first = wait_for(
            lambda: "left, silence denies" in _screen(session) and _screen(session),
            30,
            message="the approval prompt",
        )
        assert "Allow delete_file" in first
        # The prompt counts down: the seconds shown change while nobody answers.
        shown = [line for line in first.splitlines() if "left, silence denies" in line][-1]
        wait_for(lambda: shown not in _screen(session), 5, message="the countdown ticks")
        _tmux(session, "send-keys", "-t", session, "y", "Enter")
        done = wait_for(
            lambda: "EXIT=" in _screen(session) and _screen(session), 30, message="agentq run exits"
        )
        assert "EXIT=0" in done, done
        assert "delete_file" in done and "ok" in done
    finally:
        _tmux(session, "kill-session", "-t", session, check=False)


def test_a_sub_agents_approval_is_asked_and_answered_in_the_terminal(
    fleet, llm_server, agentq_env
) -> None:
    child_key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "/tmp/sub"}))),
        Round(text="child deleted"),
    )
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_asker", {"prompt": f"{child_key} go"}))),
        Round(text="Lead saw it done."),
    )
    session = f"agentq-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in agentq_env.items())
    cmd = (
        f"env {env} {sys.executable} -m agentq run --agent t_boss {shlex.quote(key)};"
        " echo EXIT=$?; sleep 60"
    )
    _tmux(session, "new-session", "-d", "-s", session, "-x", "160", "-y", "40", cmd)
    try:
        first = wait_for(
            lambda: "left, silence denies" in _screen(session) and _screen(session),
            30,
            message="the sub-agent's approval prompt",
        )
        # The request comes from the child turn, relayed into the parent's stream.
        assert "[t_asker] Allow delete_file" in first, first
        _tmux(session, "send-keys", "-t", session, "y", "Enter")
        done = wait_for(
            lambda: "EXIT=" in _screen(session) and _screen(session), 30, message="agentq run exits"
        )
        assert "EXIT=0" in done, done
        # The child's tool line nests under the agent call's line.
        lines = done.splitlines()
        call = next((i for i, s in enumerate(lines) if "ask_asker" in s and " ok" in s), -1)
        assert call >= 0, done
        assert "└ delete_file" in lines[call + 1] and " ok" in lines[call + 1], done
        assert "Lead saw it done." in done
    finally:
        _tmux(session, "kill-session", "-t", session, check=False)


def test_a_question_for_the_user_is_asked_until_the_answer_fits(
    fleet, llm_server, agentq_env
) -> None:
    ask = {"question": "Which size?", "answer_schema": {"enum": ["S", "M"]}}
    key = script(llm_server, Round(tool_calls=calls(("ask_user", ask))), Round(text="Noted."))
    session = f"agentq-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in agentq_env.items())
    run = f"{sys.executable} -m agentq run --agent asker {shlex.quote(key)}"
    cmd = f"env {env} {run}; echo EXIT=$?; sleep 60"
    _tmux(session, "new-session", "-d", "-s", session, "-x", "160", "-y", "40", cmd)
    try:
        wait_for(lambda: "Which size?" in _screen(session), 30, message="the question")
        _tmux(session, "send-keys", "-t", session, "XL", "Enter")
        wait_for(lambda: "does not fit its schema" in _screen(session), 15, message="the refusal")
        _tmux(session, "send-keys", "-t", session, '"M"', "Enter")
        done = wait_for(
            lambda: "EXIT=" in _screen(session) and _screen(session), 30, message="agentq run exits"
        )
        assert "EXIT=0" in done, done
        assert "ask_user" in done and "ok" in done
    finally:
        _tmux(session, "kill-session", "-t", session, check=False)
