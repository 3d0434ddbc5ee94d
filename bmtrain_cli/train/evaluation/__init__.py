"""Evaluation during training: the eval loss and the held-out answer accuracy."""
