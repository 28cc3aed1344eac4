"""The conversation orchestrator: the turn loop, the round dispatcher, approvals, abort."""
