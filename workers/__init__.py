"""Worker entry points of a checkout, one per process kind (see `agentq worker KIND`).

Not installed with agentq: an installed fleet runs `agentq worker KIND` or
`python -m agentq worker KIND`. In a checkout, process managers can run
`python -m workers.turns|llm|tools|io`; every Celery worker option passes through.
"""
