"""Phase-level multiplexing of several RL jobs on one rollout pool and one train pool (after RollMux)."""
