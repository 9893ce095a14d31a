"""The settings room: one typed tree of every role's settings, and each role's part of it.

- `tree.py`: the root (`SparkSettings`), presets (`configs/*.yaml`), `--set` overrides, the environment
  (`SPARKRL_*`), and writing a resolved tree; imported from here (`from sparkrl.services.common.settings
  import load_settings, LearnerSettings`).
- one module per section: `learner.py` (+ `learner_knobs.py`), `losses.py`, `rollout.py` (+
  `prompt_format.py`), `engine.py`, `prompts.py`, `evaluation.py`, `servers.py` (control, reward,
  /metrics), `sync.py`, `bus.py`, `ray.py`, `supervision.py`; `section.py` and `fields.py`, the base every
  section shares.
- `roles.py`: each service's own config (`LearnerConfig`, `RolloutConfig`, …), what it receives.
- `hparams.py`: the live hyperparameters: their names and the checks every live change passes.

Who uses it: every service and the launcher, each through its role's config.
"""

from sparkrl.services.common.settings.tree import (
    CONFIGS_DIR,
    MAX_STALENESS,
    AdvantageSettings,
    BusSettings,
    ControlSettings,
    CountdownSettings,
    EngineSettings,
    EvalSettings,
    KlSettings,
    LearnerSettings,
    LoraSettings,
    LossSettings,
    LpRegLoss,
    MetricsEndpoint,
    PromptFormat,
    PromptSettings,
    RaySettings,
    RewardSettings,
    RolloutSettings,
    SamplingSettings,
    ScheduleSettings,
    SparkSettings,
    SupervisionSettings,
    TorchEngineSettings,
    TrackingSettings,
    VllmEngineSettings,
    WeightSyncSettings,
    WorkerHealthSettings,
    describe_settings_error,
    load_settings,
    parse_override,
    write_resolved,
)

__all__ = [
    "CONFIGS_DIR",
    "MAX_STALENESS",
    "AdvantageSettings",
    "BusSettings",
    "ControlSettings",
    "CountdownSettings",
    "EngineSettings",
    "EvalSettings",
    "KlSettings",
    "LearnerSettings",
    "LoraSettings",
    "LossSettings",
    "LpRegLoss",
    "MetricsEndpoint",
    "PromptFormat",
    "PromptSettings",
    "RaySettings",
    "RewardSettings",
    "RolloutSettings",
    "SamplingSettings",
    "ScheduleSettings",
    "SparkSettings",
    "SupervisionSettings",
    "TorchEngineSettings",
    "TrackingSettings",
    "VllmEngineSettings",
    "WeightSyncSettings",
    "WorkerHealthSettings",
    "describe_settings_error",
    "load_settings",
    "parse_override",
    "write_resolved",
]
