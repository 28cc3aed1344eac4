"""Clients built on the Python API (`agentq.api`): the asyncio client (`aio`)."""
