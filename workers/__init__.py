"""Worker entry points, one per process kind (see `agentq worker KIND`).

Deployments that start processes by module path (systemd units, Procfiles, container
commands) can run `python -m workers.turns`, `python -m workers.llm` and
`python -m workers.tools`; every Celery worker option passes through.
"""
