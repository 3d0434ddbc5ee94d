"""What a training run reports: metrics.jsonl, trackers, summary.json, the console report."""
