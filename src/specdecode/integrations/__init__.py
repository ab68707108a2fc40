"""This project's parts inside other serving systems (vLLM: `specdecode.integrations.vllm`).

Nothing here imports the other system at module level: each module imports and is tested
without it installed."""
