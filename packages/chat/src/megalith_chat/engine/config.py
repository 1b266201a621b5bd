"""Configuration of a distributed GRPO run (frozen dataclasses that validate themselves)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megalith.common.errors import ConfigError
from megalith_chat.data.tasks import TASKS
from megalith_chat.modeling import LoraSpec
from megalith_chat.rewards import check_reward_spec
from megalith_chat.rollout.producer import RolloutConfig
from megalith_chat.trainer.grpo import LearnerConfig
from megalith_chat.trainer.parallel import check_parallel
from megalith_chat.trainer.pp import check_pipeline, resolve_microbatches
from megalith_chat.trainer.setup import PLUGINS, PRECISIONS


@dataclass(frozen=True)
class EngineConfig:
    """Ray placement, queueing, staleness and timeouts of the producer-consumer loop."""

    num_producers: int = 1
    num_consumers: int = 2
    max_staleness: int = 1
    queue_size: int = 2
    ray_address: str | None = None
    num_cpus: int | None = None  # local cluster only; default: os.cpu_count()
    threads_per_actor: int = 1
    startup_timeout_s: float = 300.0
    rollout_timeout_s: float = 300.0
    step_timeout_s: float = 300.0
    sync_timeout_s: float = 120.0
    sync_bucket_mb: float = 32.0
    rollout_engine: str = "auto"  # producers: "hf" generate, "fast" engine, "auto" = fast with CUDA
    # fast engine: a group's prompt prefilled and its cache read once; None: where it pays
    share_prompts: bool | None = None

    def __post_init__(self) -> None:
        if self.num_producers < 1 or self.num_consumers < 1:
            raise ConfigError(
                f"need >= 1 producer and consumer, got {self.num_producers} and {self.num_consumers}"
            )
        if self.max_staleness < 0 or self.queue_size < 1 or self.threads_per_actor < 1:
            raise ConfigError(
                f"need max_staleness >= 0, queue_size >= 1, threads_per_actor >= 1; got "
                f"{self.max_staleness}, {self.queue_size}, {self.threads_per_actor}"
            )
        if self.rollout_engine not in ("auto", "hf", "fast"):
            raise ConfigError(f"rollout_engine must be auto, hf or fast, got {self.rollout_engine!r}")
        timeouts = (self.startup_timeout_s, self.rollout_timeout_s, self.step_timeout_s, self.sync_timeout_s)
        if min(timeouts) <= 0:
            raise ConfigError(f"every timeout must be > 0, got {timeouts}")


@dataclass(frozen=True)
class PromptSource:
    """Where prompts and rewards come from: a built-in task or a JSONL file plus a reward spec.

    ``system_prompt`` becomes the system turn of every prompt that has none; a prompt that has
    one (a prompts file's ``system`` field or system message) keeps its own.
    """

    task: str | None = "arithmetic"
    prompts_file: str | None = None
    reward: str | None = None  # reward spec; default: the task's reward
    num_prompts: int = 512
    seed: int = 0
    task_options: tuple[tuple[str, int | str], ...] = ()
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if (self.task is None) == (self.prompts_file is None):
            raise ConfigError("give exactly one of a built-in task or a prompts file")
        if self.task is not None and self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}; expected one of {sorted(TASKS)}")
        if self.prompts_file is not None and self.reward is None:
            raise ConfigError("a prompts file needs a reward spec (e.g. 'math=1,answer_format=0.2')")
        if self.reward is not None and self.reward not in TASKS:
            check_reward_spec(self.reward)  # import paths are imported by the producers only
        if self.num_prompts < 1:
            raise ConfigError(f"num_prompts must be >= 1, got {self.num_prompts}")


@dataclass(frozen=True)
class GRPORunConfig:
    """Everything a ``chat-train grpo`` run needs."""

    model: str = "smollm2"
    out_dir: str = "runs/grpo"
    data_dir: str | None = None
    prompts: PromptSource = field(default_factory=PromptSource)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    lora: LoraSpec | None = None
    steps: int = 20
    prompts_per_step: int = 2
    lr: float = 1e-5
    weight_decay: float = 0.0
    plugin: str = "zero2"
    precision: str = "fp32"
    seed: int = 0
    save_every: int = 0
    resume: bool = False
    eval_every: int = 0
    eval_prompts: int = 0
    export: bool = True
    tp: int = 1  # consumer ranks per tensor-parallel group (trainer/parallel.py)
    sp_mode: str = "none"
    pp: int = 1  # pipeline stages over the consumer ranks (trainer/pp.py)
    pp_schedule: str = "1f1b"
    num_microbatches: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.prompts_per_step < 1:
            raise ConfigError(
                f"need steps >= 1 and prompts_per_step >= 1, got {self.steps}, {self.prompts_per_step}"
            )
        if self.plugin not in PLUGINS or self.precision not in PRECISIONS:
            raise ConfigError(f"plugin must be one of {PLUGINS} and precision one of {PRECISIONS}")
        if self.lr <= 0 or self.save_every < 0 or self.eval_every < 0 or self.eval_prompts < 0:
            raise ConfigError("need lr > 0 and save_every, eval_every, eval_prompts >= 0")
        check_parallel(self.tp, self.sp_mode, self.lora is not None)
        check_pipeline(self.pp, self.tp, self.lora is not None, "grpo", self.pp_schedule)
        if self.engine.num_consumers % self.tp:
            raise ConfigError(
                f"num_consumers = {self.engine.num_consumers} is not divisible by tp = {self.tp} "
                "(the consumers form tensor-parallel groups of tp ranks)"
            )
        if self.engine.num_consumers % (self.tp * self.pp):
            raise ConfigError(
                f"num_consumers = {self.engine.num_consumers} is not divisible by tp x pp = "
                f"{self.tp} x {self.pp} (the consumers form pipelines of pp stages of tp ranks)"
            )
        if self.pp > 1 and self.eval_every:
            raise ConfigError(
                f"eval_every = {self.eval_every} needs generation on the consumers, which pp = {self.pp} "
                "does not support (every pipeline rank holds only some layers)"
            )
        if self.sp_mode != "none" and self.eval_every:
            raise ConfigError(
                f"eval_every = {self.eval_every} needs generation on the consumers, which "
                f"sp_mode={self.sp_mode!r} does not support (one new token is no sequence to split)"
            )
        if self.rollout.group_size < 2:
            raise ConfigError(
                f"group_size = {self.rollout.group_size}: the {self.learner.advantage!r} advantage compares "
                "the samples of a prompt with each other, so it needs group_size >= 2 (a group of one "
                "gets advantage 0 and teaches nothing)"
            )
        samples = self.prompts_per_step * self.rollout.group_size
        dp = self.engine.num_consumers // (self.tp * self.pp)
        if samples % dp:
            raise ConfigError(
                f"prompts_per_step * group_size = {samples} samples must divide evenly over "
                f"{dp} data-parallel consumer ranks (num_consumers / (tp x pp))"
            )
        if self.pp > 1:
            resolve_microbatches(
                self.pp, samples // dp, self.num_microbatches, "samples per data-parallel rank"
            )

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per step (pp > 1)."""
        samples = self.prompts_per_step * self.rollout.group_size
        rows = samples // (self.engine.num_consumers // (self.tp * self.pp))
        return resolve_microbatches(self.pp, rows, self.num_microbatches, "samples per data-parallel rank")
