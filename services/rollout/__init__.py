"""Rollout worker: engines (torch on CPU, vLLM on GPU), the generate-score-publish loop, weight receiver."""
