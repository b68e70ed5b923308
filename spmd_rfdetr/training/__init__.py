"""``fit``: the one build path, the compiled step, EMA, checkpoints, metrics and evaluation inside the run."""
