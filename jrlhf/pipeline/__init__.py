"""A run end to end: task data, the supervised stages (SFT, reward model), the RL stage."""
