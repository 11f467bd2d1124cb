"""RL math: masked reductions and loss aggregation (core), advantages, policy/KL/value losses, off-policy weights."""
