"""Checkpoints of a training run: saving and resuming, the files of a step-N, the optimizer state and the random generators' states."""
