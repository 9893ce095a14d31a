"""What more than one service uses, and nothing else. Its rooms:

- `settings/`: the typed settings tree, each role's part of it (`roles.py`) and the live hyperparameters'
  checks (`hparams.py`) — every service and the launcher.
- `tasks/`: the built-in tasks, answers, data sets and held-out evaluation — the feeder, the reward
  service, the evaluator, `sparkrl eval`.
- `bus/`: the Redis streams and values every service talks through.
- `weight_sync/`: the weight transport (announce → verify → ack), the learner's side and the workers'.

and, one module each: the telemetry channel (`telemetry.py`), the control stream (`control_channel.py`),
model and tokenizer loading (`modeling.py`, `tiny_model.py`), the prompt feeder (`feeder.py`), the reward
client (`reward_client.py`), recovery after Redis lost its data (`recovery.py`), HTTP and /metrics helpers
(`http.py`, `metrics_server.py`, `thread_server.py`), logging (`logs.py`), paths (`paths.py`) and start-up
phases (`start_clock.py`).
"""
