"""The training data: datasets and their loader (``loading``), packing (``packing``), a model's own HF tokenizer
(``tokenizer``). Configs name the tokenizer as ``finetune.data.HFTokenizer``."""

from finetune.data.tokenizer import HFTokenizer

__all__ = ["HFTokenizer"]
