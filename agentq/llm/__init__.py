"""The model side: one streamed round, its inactivity watchdog and its retry rules."""
