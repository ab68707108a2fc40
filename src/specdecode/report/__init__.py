"""The reporting half of the benchmark: what a run's results say (bench measures them, bench.store
keeps them). `analysis` (summaries, speedups and their intervals, acceptance, latency), `frontier`
(several targets: speed against fidelity), `recommend` (what to enable), `summary` (the text a
run prints), `html` (the self-contained report.html, with `figures`, `targets` and `audit` its
sections; `svg` draws), `traffic` (open-loop traffic and goodput), `compare` (two runs)."""
