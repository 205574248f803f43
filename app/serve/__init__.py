"""`llmlocal serve`'s HTTP server over the `Engine`: the server and its routing (server),
who may connect (access, connections), Prometheus metrics, the request helpers both APIs share
(protocol), and OpenAI's and Ollama's routes (openai_api, ollama_api)."""
