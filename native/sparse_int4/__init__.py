"""INT4 GEMV over a column-major layout that skips the weights of zero activations (CPU, C)."""
