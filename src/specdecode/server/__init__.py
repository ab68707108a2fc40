"""An OpenAI-compatible HTTP server over the batched speculative engine.

Layout: `protocol` (request schemas and response shapes), `errors` (OpenAI-style error bodies),
`middleware` (API key, body size), `metrics` (Prometheus), `worker` (the one engine thread),
`prepare` (a validated request -> a Generation), `streaming` (events -> SSE / JSON), `app`
(the routes), `background` (run a server in a thread), `cli` (`specdecode serve`).
"""
