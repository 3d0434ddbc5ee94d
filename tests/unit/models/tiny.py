"""The tiny architecture the model tests share (hidden 64, 2 layers, GQA 4/2, odd vocabulary)."""

from bmtrain_cli.models.arch import ModelArch

TINY = ModelArch(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    initializer_range=0.15,
)
