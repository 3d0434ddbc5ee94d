"""The tile size of the quantised linear layer's CPU kernels (ops/quant_linear.py), without a Paddle
import: the memory planner counts it as the dequantisation workspace."""

TILE_ELEMENTS = 1 << 22  # dequantised weights alive at once on the custom path (16 MiB in fp32)
