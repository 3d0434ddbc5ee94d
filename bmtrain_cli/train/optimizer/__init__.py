"""The optimizer side of training: AdamW and its parameter groups, clipping and mixed precision, the CPU AdamW, optimizer offload, the learning-rate schedule."""
