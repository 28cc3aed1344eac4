"""Signed webhooks when a turn ends (Standard Webhooks), delivered at least once.

`target` says where agentq may post (https, public addresses, checked after resolution);
`post` signs and sends one attempt; `backoff` decides, without waiting, what an attempt's
answer means and when the next is due; `deliveries` keeps each delivery in Redis; `task`
runs one attempt on the webhook queue and sweeps for due retries.
"""
