"""A low-bit frozen base for QLoRA: the storage formats (formats.py, numpy), the quantised linear layer
(layer.py) and which layers of a model are quantised (select.py). See docs/qlora.md."""
