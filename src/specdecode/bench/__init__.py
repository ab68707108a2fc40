"""`specdecode bench`: measure speculative decoding on your own traffic. What the measurements
say (analysis, recommendation, the reports) is the package `specdecode.report`.

Modules, in the order data flows through them:

- `workloads`: prompts (Spec-Bench JSONL or a plain JSONL format) and the built-in default set;
  `requests`: OpenAI request lines (a `serve --record` recording, a proxy's log) among them.
- `arrivals`: when requests start (closed loop, the recorded times, a Poisson rate);
  `openloop`: the open-loop replay of a schedule, window by window.
- `runner`: the `Runner` protocol an engine implements to produce measurements.
- `inprocess`: the Runner on this package's engine (batch 1 alone, batches and k = "auto" on the
  BatchEngine); `costcurves`: its c(k), v(k) measurement; `peers`: llama-cpp-python's own
  generation, measured beside it on the llama.cpp backend; `targets`: several targets of one
  model (precisions, llama.cpp) in one interleaved run.
- `http_runner`: the Runner over any OpenAI-compatible server; `http_metrics`: the speculation
  counters of its /metrics; `http_constraints`: structured output sent and judged over HTTP;
  `http_audit`: the losslessness audit of a server against a plain one.
- `records`: the versioned result schema (one `RequestSample` per request per configuration).
- `store`: the append-only JSONL file results are written to as they are measured, and resume.
- `harness`: the loop interleaving configurations over the same prompts; `interference`: how busy
  the machine was around each measured batch, and which measurements that disturbed.
- `hardware`: the machine description every report states; `costs`: `specdecode costs`, the
  forward-cost curves.
- `options`: BenchOptions, what `bench` and `tune` are asked, built by every front end;
  `plan`: what they run, checked before a model loads (their commands: `cli`).
"""
