"""The tasks room: what a prompt asks and how an answer is read, shared by the feeder, the reward
service, the evaluator and the benchmarks.

- `countdown.py`: the built-in countdown task (problems, the prompt, the checker).
- `answers.py`: reading a final answer out of a completion (boxed, last number, …).
- `datasets.py`: prompts from jsonl / parquet files and the built-in tasks.
- `evaluation.py`: held-out evaluation (pass@k, greedy), used by the evaluator and `sparkrl eval`.
"""
