"""Imported by the verifier pool's forkserver, and by nothing else: it makes every forked worker start warm.

The forkserver imports this once; each worker is a fork of it, so the imports and the lazily built state
exercised here (antlr's LaTeX parser, sympy's caches) are inherited instead of rebuilt after every restart
— otherwise the first item a fresh worker scores costs 0.1-1 s and eats into its time limit.
"""

import logging

from sparkrl.services.reward.verifiers import run_verifier, verify_math

_WARM_UP = (
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{x^2 + \\sqrt{3}}", "\\sqrt3 + x^2"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3, \\pi/2)"),
    ("\\boxed{[0, 1)}", "\\{1, 2\\}"),
    ("the answer is 12", "\\text{(C)}"),
)


def warm_up() -> None:
    """Score a few typical answers (sets, intervals, surds, text), discarding the results.

    Through `run_verifier`, which never raises: the forkserver survives only ImportErrors of its preloads.
    """
    # Quiet: math_verify warns once that its own timeout is off (the pool owns timeouts).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for completion, answer in _WARM_UP:
        run_verifier(verify_math, completion, answer, None)


warm_up()
