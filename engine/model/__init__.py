"""The paged engine's model code: a Llama-family decoder over a paged KV cache, and its loaders."""
