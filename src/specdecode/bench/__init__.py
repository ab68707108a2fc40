"""`specdecode bench`: measure speculative decoding on your own traffic and report on it.

Modules, in the order data flows through them:

- `workloads`: prompts (Spec-Bench JSONL or a plain JSONL format) and the built-in default set.
- `runner`: the `Runner` protocol an engine implements to produce measurements.
- `inprocess`: the Runner on this package's engine (batch 1 alone, batches and k = "auto" on the
  BatchEngine); `costcurves`: its c(k), v(k) measurement.
- `records`: the versioned result schema (one `RequestSample` per request per configuration).
- `store`: the append-only JSONL file results are written to as they are measured, and resume.
- `harness`: the loop interleaving configurations over the same prompts.
- `analysis`: percentiles, bootstrap confidence intervals and per-configuration aggregates.
- `recommend`: whether to enable speculation, with which drafter and k, up to which batch size.
- `report_html`, `summary`, `svg`: the self-contained HTML report and the terminal summary.
- `hardware`: the machine description every report states.
- `compare`: what changed between two reports (after a target swap or an upgrade).
- `plan`: what `bench` and `tune` run, checked before a model loads (their commands: `cli`).
"""
