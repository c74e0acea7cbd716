"""What a run shows and records: the console and per-rank logs, metrics.jsonl and the optional
trackers (W&B, TensorBoard), the profiler, the memory probe and the failure summary."""
