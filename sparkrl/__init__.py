"""sparkrl: distributed RL from verifiable rewards with Lp-Reg.

`sparkrl.proto` (the folder `proto/`) holds the wire contracts; `sparkrl.services` (the folder `services/`)
holds the rollout, learner and reward services and what they share in `services/common/`.
"""

__version__ = "0.1.0"
