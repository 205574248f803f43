"""What `llmlocal bench` measures, and the memory model's check: clients of the engine that load
it as a user would (each engine in a process of its own where figures are compared), run it
and report JSON-ready figures. `scenarios` holds decode, batch, prefix and prefill and the
helpers the others share; `spec`, `sparse`, `grammar` and `resume` one scenario each;
`memory_check` measures what loading and a filled context really cost against
`engine.planning.memory_model`'s prediction."""
