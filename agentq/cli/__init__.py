"""The `agentq` command line."""
