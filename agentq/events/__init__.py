"""The event bus: every step of a turn on Redis pub/sub, with a replayable log."""
