"""The TRL peer (`../shared/peers/trl_same_model.py`) saving the model every `--save-every` steps, for the
time-to-quality figure (`bench/e2e_bench.py` scores each saved model on the held-out problems and dates it
by its files).

usage: VENV/bin/python bench/trl_checkpoints.py --save-every 40 PEER_SCRIPT [the peer's arguments...]

The peer builds its GRPOConfig itself (`save_strategy="no"`); this runs it with a GRPOConfig that saves
the model alone (no optimizer state: less work than sparkrl's checkpoints) into the peer's --workdir as
transformers' `checkpoint-N/`. Nothing else of the peer changes.
"""

import os
import runpy
import sys

every = int(sys.argv[2]) if sys.argv[1] == "--save-every" else 0
peer, argv = sys.argv[3], sys.argv[4:]
if every < 1 or "--workdir" not in argv:
    raise SystemExit("usage: trl_checkpoints.py --save-every N PEER_SCRIPT ... --workdir DIR ...")
threads = argv[argv.index("--threads") + 1] if "--threads" in argv else "2"  # the peer's own default
for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # as the peer sets them, before torch is imported
    os.environ.setdefault(name, threads)

import trl  # noqa: E402

_post_init = trl.GRPOConfig.__post_init__


def _saving_post_init(self: trl.GRPOConfig) -> None:
    self.save_strategy, self.save_steps, self.save_only_model = "steps", every, True
    _post_init(self)


# Patched in place, not subclassed: the trainer pickles its config into each checkpoint, and a class of
# this script's `__main__` cannot be found again once runpy has replaced it.
trl.GRPOConfig.__post_init__ = _saving_post_init
sys.argv = [peer, *argv]
runpy.run_path(peer, run_name="__main__")
