"""Observability: trace spans (OpenTelemetry, optional), JSON logs and the ids both carry;
off unless configured, at the cost of one boolean test on the hot path."""
