"""An OpenAI-compatible HTTP server over the batched speculative engine.

Layout: `protocol` (request schemas and response shapes), `openai_errors` (OpenAI-style error
bodies), `middleware` (API key, body size and time), `connections` (the header deadline),
`prometheus` (the /metrics exposition), `worker` (the one engine thread), `tokens` (prompt
tokenization: message contents as text, off the GIL), `prepare` (a validated request -> a
Generation), `streaming` (events -> SSE / JSON), `app` (the routes), `shutdown` (the drain on
SIGTERM), `background` (uvicorn servers, run in a thread or draining on signals), `state` (what a
running server holds, built from the loaded model and ServeOptions), `isolation` (whose earlier
text a `suffix` drafter may draft from), `allocator` (giving freed memory back to the system),
`record` (`--record`: the traffic accepted, as workload lines), `speculation` (whether
speculation pays, live, per request label: /metrics and /v1/speculation).
`specdecode serve` is `cli.serve`. The limits and their flags: docs/serving-hardening.md.
"""
