"""The learner: its loop (learner.py), the trainer under DeepSpeed (trainer.py, ranks.py), the step's update
(update.py: collation in batch.py and prompt_sharing.py, log-probs in logprobs.py, the Lp-Reg proxy in
proxy.py), exactly-once (ledger.py), checkpoints (checkpoint.py, checkpoint_folder.py), the weight
publisher (publisher.py) and its service (service.py). The losses themselves are in
`services/common/losses/` (their settings are checked live by the control service).
"""
