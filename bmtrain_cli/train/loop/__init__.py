"""The training step and what runs around it: the step, the SFT token loss, early stopping, the compiled forward, pipeline re-balancing."""
