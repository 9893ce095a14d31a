"""The TRL peer (`../shared/peers/trl_same_model.py`) with EOS suppressed: every completion is exactly
`--max-new` tokens, as sparkrl's `sampling.min_new_tokens` makes them for the `long` workload.

usage: VENV/bin/python bench/trl_fixed_length.py PEER_SCRIPT [the peer's arguments...]

TRL passes `GRPOConfig.generation_kwargs` into the `GenerationConfig` it samples with; `min_new_tokens`
is transformers' documented EOS suppression. The peer script builds its GRPOConfig itself, so this runs it
with a GRPOConfig whose generation_kwargs carry that one setting; nothing else of the peer changes.
"""

import os
import runpy
import sys

peer, argv = sys.argv[1], sys.argv[2:]
min_new = int(argv[argv.index("--max-new") + 1])
threads = argv[argv.index("--threads") + 1] if "--threads" in argv else "2"  # the peer's own default
for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # as the peer sets them, before torch is imported
    os.environ.setdefault(name, threads)

import trl  # noqa: E402  (after the thread settings, like the peer)


class FixedLengthGRPOConfig(trl.GRPOConfig):
    def __post_init__(self) -> None:
        self.generation_kwargs = {**(self.generation_kwargs or {}), "min_new_tokens": min_new}
        super().__post_init__()


trl.GRPOConfig = FixedLengthGRPOConfig
sys.argv = [peer, *argv]
runpy.run_path(peer, run_name="__main__")
