"""Multiple-choice benchmarks (MMLU, C-Eval, CMMLU, a generic JSONL layout) read from local files and
scored by the log-likelihood of each choice, as lm-evaluation-harness scores them (docs/eval.md)."""
