"""MCP servers as governed tools: their configuration, sessions, tool listings and calls."""
