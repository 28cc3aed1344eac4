"""What ``agentq dev`` runs on one machine: processes by PID and an embedded Redis."""
