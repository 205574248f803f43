"""The paged engine's runtime, what every step passes through: the scheduler (admission,
chunked prefill, preemption), the block manager (the paged KV pool and its prefix cache) and
its disk tier (kv_disk), sequences, the model runner (a step's token layout, slot mappings,
block tables), sampling, per-step token masks, CUDA graphs and the statistics a request
reports."""
