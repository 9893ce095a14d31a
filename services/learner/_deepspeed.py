"""DeepSpeed, imported without what the learner never uses: its autotuner imports mlflow whenever mlflow
is installed (about a second of the learner's start on a CPU, on the path to the first step) only to log
autotuning runs, which the learner never starts. While DeepSpeed is imported, `import mlflow` fails for it
(`has_mlflow` is then False in the autotuner); afterwards mlflow imports as usual (`tracking: [mlflow]`).
Importing this module does it: the learner service (service.py) imports it before anything that imports
DeepSpeed; the learner package itself does not, so importing the losses alone stays light."""

from __future__ import annotations

import sys


def import_deepspeed() -> None:
    """Import DeepSpeed once, keeping mlflow out of that import; nothing if either is imported already."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # Python's documented "import fails" marker
    try:
        import deepspeed  # noqa: F401
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


import_deepspeed()
