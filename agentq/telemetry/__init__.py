"""Observability: trace spans (OpenTelemetry, optional), JSON logs, and the log context
(`turn_id`, `call_id`, `task_id`) that both carry.

Everything here is off unless configured, and costs one boolean test on the hot path
when off: see docs/operations.md.
"""
