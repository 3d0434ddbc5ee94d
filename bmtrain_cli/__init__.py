"""bmtrain-cli: a PaddlePaddle-native, YAML-driven command line for fine-tuning LLMs."""

__version__ = "0.1.0"
