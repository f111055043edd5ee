"""hf_onebit: communication-compressed optimizers for stock PyTorch DDP and Hugging Face."""

__version__ = "0.1.0.dev0"
