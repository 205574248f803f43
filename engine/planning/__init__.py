"""Which configuration to run and why: the memory planner, its search over candidates, the
memory model it predicts with, this machine's hardware, and what the native kernels run
faster than llama.cpp."""
