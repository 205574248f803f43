"""Kernels: each a launcher, a pure reference, a test and a benchmark."""
