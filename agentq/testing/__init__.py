"""Test doubles shipped with agentq, so users test their tools the way we test ours."""
