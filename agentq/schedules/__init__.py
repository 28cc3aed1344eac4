"""Scheduled agent runs: `spec` (what a schedule is), `store` (adding, listing, removing
them as celery-redbeat entries), `beat` (the scheduler `agentq beat` runs).

celery-redbeat keeps the entries in Redis and lets one beat at a time fire them (a Redis
lock the others wait for); the tick task that starts the turn is idempotent per tick, so
a beat that lost its lock mid-tick cannot start a second turn either.
"""
