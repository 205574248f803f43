"""Conversion of Hugging Face checkpoints and GGUF files to GGUF, and quality evaluation."""
