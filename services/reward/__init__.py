"""Reward service: the FastAPI verifier for math answers, built-in tasks and custom verifiers."""
