"""agentq: LLM agent turns as background jobs on a Celery fleet."""
