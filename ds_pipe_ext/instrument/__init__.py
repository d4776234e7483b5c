"""Per-stage instrumentation of pipeline training, and the predicted-vs-measured report."""
