"""The V-cycle trainer: phases, learning-rate schedules, FLOPs, checkpoints, metrics."""
