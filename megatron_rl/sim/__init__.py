"""Cost model, planner and simulator for cluster layouts (no GPU needed)."""
