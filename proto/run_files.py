"""What a run directory holds for other processes to read: the lock of a live run (`RUN_DIR/run.lock`), the
run's owner (`RUN_DIR/owner.json`, and in Redis the lease of its bus namespace) and the dead letters the run
left (`RUN_DIR/dead_letters.jsonl`, one record a line).

Writer: `sparkrl up` (both). Readers: a second `sparkrl up` on the same directory (the lock), `sparkrl
dead` and `sparkrl report` (the lock: is the run live?), `sparkrl dead` and the run's summary (the dead
letters, once the run is over and its private Redis is gone).
"""

from typing import Literal

from pydantic import Field

from sparkrl.proto.base import WireModel

RUN_FILES_SCHEMA_VERSION = 1

# A service's exit code that says its set-up is wrong (sysexits' EX_CONFIG): restarting it cannot help, so
# `sparkrl up` ends the run with the service's last log lines instead. Writer: a rollout worker whose engine
# cannot take the learner's tensors (`WeightsDoNotFit`). Reader: the launcher's supervision.
EXIT_UNFIT = 78


class RunLock(WireModel):
    """`RUN_DIR/run.lock`: the directory is live, held by this process until it exits."""

    schema_version: Literal[1] = Field(
        default=RUN_FILES_SCHEMA_VERSION, description="File version; readers reject others."
    )
    pid: int = Field(ge=1, description="The process holding the run (`sparkrl up`). Writer: that process.")
    host: str = Field(
        min_length=1,
        max_length=255,
        description="Hostname of the holder: its pid means something only there. Writer: the holder.",
    )
    pid_started: int | None = Field(
        default=None,
        ge=0,
        description="When the holder started (clock ticks since boot, /proc/<pid>/stat), so a pid the "
        "system reused for another process is not taken for the holder. None: not on Linux.",
    )
    since: float = Field(ge=0, description="When it took the directory, Unix seconds. Writer: the holder.")
    command: str = Field(
        max_length=200, description="What holds it, for people: `sparkrl up`, `sparkrl up --ray`."
    )


class RunOwner(WireModel):
    """The run that owns a bus namespace: in Redis as `{ns}:value:owner`, a lease its learner renews (it
    expires `bus.owner_ttl_s` after the last renewal), and in `RUN_DIR/owner.json` as the fence: only the
    learner whose record it is may write checkpoints, `latest` or `ended.json` there.

    Writer: the learner, when it claims the namespace (the bus sets `generation`). Readers: a learner of
    another run (refused while the lease lives), `sparkrl up` before it spawns anything, workers and
    feeders with a run id, and an earlier learner of the same run before it writes into the run directory.
    """

    schema_version: Literal[1] = Field(
        default=RUN_FILES_SCHEMA_VERSION, description="Record version; readers reject others."
    )
    run_id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="The run (`bus.run_id`, RUN_DIR/run-id): a resume is the same run.",
    )
    generation: int = Field(
        default=0,
        ge=0,
        description="The claim's number in this namespace, counted by Redis (the fencing token): each "
        "learner start gets a new one. 0: not claimed yet.",
    )
    run_dir: str = Field(max_length=4096, description="The run directory of the learner holding it.")
    host: str = Field(min_length=1, max_length=255, description="The learner's hostname.")
    pid: int = Field(ge=1, description="The learner's process id, on `host`.")
    since: float = Field(ge=0, description="When it claimed the namespace, Unix seconds.")


DeadLetterStream = Literal["prompts", "trajectories"]


class DeadLetterRecord(WireModel):
    """One line of `RUN_DIR/dead_letters.jsonl`: a dead letter as the run left it (without its payload)."""

    schema_version: Literal[1] = Field(
        default=RUN_FILES_SCHEMA_VERSION, description="File version; readers reject others."
    )
    record_id: str = Field(description="Its id in the run's dead-letter stream (`sparkrl dead --requeue`).")
    stream: DeadLetterStream = Field(
        description="Where it came from: `prompts` (set aside by a worker), `trajectories` (a group set "
        "aside by the learner)."
    )
    item_id: str = Field(description="The prompt id or group id it was published under.")
    reason: str = Field(description="Why it was set aside, as the service that did it said.")
    time_ms: int = Field(ge=0, description="When, Unix milliseconds.")
    deliveries: int = Field(ge=0, description="How often it had been delivered by then.")


class PromptCounts(WireModel):
    """How the prompts of a run whose data ran out ended: `RUN_DIR/ended.json`'s `prompts`. Every prompt
    fed is trained, filtered, dead-lettered or dropped. Writer: learner. Readers: people, scripts, tests."""

    fed: int = Field(ge=0, description="Prompts fed, every epoch counted (`sparkrl prompts`' done mark).")
    epochs: int = Field(ge=1, description="Passes over the data.")
    trained: int = Field(ge=0, description="Prompts whose group was trained (the learner's groups trained).")
    filtered: int = Field(
        default=0,
        ge=0,
        description="Prompts whose group was filtered as uninformative (learner.filter_groups: all rewards "
        "equal): used, never trained.",
    )
    dead_lettered_prompts: int = Field(
        ge=0, description="Prompts the workers set aside (too long, failed generation, ...): `sparkrl dead`."
    )
    dead_lettered_groups: int = Field(
        ge=0, description="Groups the learner set aside (its model cannot take them, loss not finite)."
    )
    dead_letters_trimmed: bool = Field(
        description="The dead-letter stream held bus.dead_letter_maxlen records: the counts are a minimum."
    )
    dropped: int = Field(ge=0, description="Fed, yet neither trained nor dead-lettered: lost.")
    sampled_again: int = Field(
        ge=0,
        description="Groups that went stale (older than learner.max_staleness) and whose prompt was fed "
        "again to be made anew; those prompts count as trained once their new group was.",
    )
