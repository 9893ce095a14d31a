"""Wire contracts: every message that crosses a process, and the binary codec for its tensors.

Import from here (`from sparkrl.proto import TrajectoryGroup, encode_group`); the submodules are the
implementation. This package needs only pydantic, numpy and msgpack, so it installs into a rollout
worker's own (vLLM) environment.
"""

from sparkrl.proto.codec import MAGIC, decode_group, decode_message, encode_group, encode_message
from sparkrl.proto.control import (
    CONTROL_SCHEMA_VERSION,
    CheckpointCommand,
    ControlBody,
    ControlCommand,
    ControlState,
    HparamValue,
    HyperparameterPatch,
    PauseCommand,
    ResumeCommand,
    SetHparamsCommand,
    StopCommand,
)
from sparkrl.proto.errors import CodecError, FieldError
from sparkrl.proto.group import TrajectoryGroup
from sparkrl.proto.partial import PARTIAL_SCHEMA_VERSION, PartialGroup
from sparkrl.proto.ranks import RankOrder
from sparkrl.proto.reward import (
    REWARD_SCHEMA_VERSION,
    RewardItem,
    RewardRequest,
    RewardResponse,
    RewardResult,
)
from sparkrl.proto.status import STATUS_SCHEMA_VERSION, EpisodeTally, LearnerStatus, WorkerStatus
from sparkrl.proto.telemetry import (
    METRIC_NAMESPACES,
    TELEMETRY_SCHEMA_VERSION,
    CommandResult,
    EvalRecord,
    StateEvent,
    StepMetrics,
    SyncEvent,
)
from sparkrl.proto.tensors import Float32Array1D, Float32Array2D, Int32Array1D, Int32Array2D, NdArray
from sparkrl.proto.trajectory import (
    TRAJECTORY_SCHEMA_VERSION,
    ChatMessage,
    Completion,
    Prompt,
    SamplingParams,
    completions_of_rows,
    group_id_for,
)
from sparkrl.proto.views import (
    CheckpointRequest,
    CommandResponse,
    CommandTimeout,
    EvalsPage,
    MetricsPage,
    PauseRequest,
    StatusView,
    StopRequest,
    WeightsPage,
    WorkersView,
    WorkerView,
)
from sparkrl.proto.weights import (
    CHECKSUM_ALGORITHM,
    DTYPE_ITEMSIZE,
    WEIGHTS_SCHEMA_VERSION,
    TensorSpec,
    WeightAnnouncement,
    WeightDtype,
    announcement_verifies,
    sign_announcement,
    weights_checksum,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CONTROL_SCHEMA_VERSION",
    "DTYPE_ITEMSIZE",
    "MAGIC",
    "METRIC_NAMESPACES",
    "PARTIAL_SCHEMA_VERSION",
    "REWARD_SCHEMA_VERSION",
    "STATUS_SCHEMA_VERSION",
    "TELEMETRY_SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA_VERSION",
    "WEIGHTS_SCHEMA_VERSION",
    "ChatMessage",
    "CheckpointCommand",
    "CheckpointRequest",
    "CodecError",
    "CommandResponse",
    "CommandResult",
    "CommandTimeout",
    "Completion",
    "ControlBody",
    "ControlCommand",
    "ControlState",
    "EpisodeTally",
    "EvalRecord",
    "EvalsPage",
    "FieldError",
    "Float32Array1D",
    "Float32Array2D",
    "HparamValue",
    "HyperparameterPatch",
    "Int32Array1D",
    "Int32Array2D",
    "LearnerStatus",
    "MetricsPage",
    "NdArray",
    "PartialGroup",
    "PauseCommand",
    "PauseRequest",
    "Prompt",
    "RankOrder",
    "ResumeCommand",
    "RewardItem",
    "RewardRequest",
    "RewardResponse",
    "RewardResult",
    "SamplingParams",
    "SetHparamsCommand",
    "StateEvent",
    "StatusView",
    "StepMetrics",
    "StopCommand",
    "StopRequest",
    "SyncEvent",
    "TensorSpec",
    "TrajectoryGroup",
    "WeightAnnouncement",
    "WeightDtype",
    "WeightsPage",
    "WorkerStatus",
    "WorkerView",
    "WorkersView",
    "announcement_verifies",
    "completions_of_rows",
    "decode_group",
    "decode_message",
    "encode_group",
    "encode_message",
    "group_id_for",
    "sign_announcement",
    "weights_checksum",
]
