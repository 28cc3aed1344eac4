"""Scheduled agent runs, fired by `agentq beat`, one turn each."""
