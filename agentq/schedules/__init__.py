"""Scheduled agent runs: `spec` (what a schedule is), `store` (adding, listing, removing
them as celery-redbeat entries in Redis), `beat` (the scheduler `agentq beat` runs, one at
a time by a Redis lock, each tick named so that it starts one turn).
"""
