"""Training drafters on the target: corpora, resumable checkpoints, heads, distillation."""
