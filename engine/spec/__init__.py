"""Speculative decoding: the drafters (a draft model, n-gram lookup), the verification of
drafted tokens against the target (greedy and sampled, exact in distribution) and the
controller that picks each sequence's draft length."""
