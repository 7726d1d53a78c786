"""The rollout-backend seam: what the RL loop asks of rollouts, and the registry that picks one from config.

Why the interface is async: the loop in train.py is a coroutine and every backend method is one. The HTTP
backend is asyncio by nature (aiohttp client, scheduler tasks admitting and completing groups); because the
loop runs on the same event loop and puts the learner step in a worker thread (asyncio.to_thread), those
tasks keep generating and scoring while the learner computes: the async overlap. An in-process backend (the
lag emulator, a test double) simply does its work inside the coroutine. The alternative, a backend running
its own event loop in a thread, would need cross-thread futures on every call and a second shutdown path
for Ctrl-C; one event loop owned by the job keeps cancellation and cleanup in one `finally`.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Iterator, Optional, TypeVar

import ml_collections

from vcpo_jax import registry
from vcpo_jax.rollout.rewards import Rewarder
from vcpo_jax.rollout.types import Group


@dataclasses.dataclass(frozen=True)
class RolloutContext:
  """What the job hands a backend besides its config."""
  model_cfg: Any  # model.ModelConfig: vocab size, exports
  tokenizer: Any  # stop/pad ids, exported with the weights
  prompts: Iterator[dict]  # the job's prompt iterator; checkpointed with the backend's state_dict
  rewarder: Rewarder  # the task's reward and its pool; backends score each group as it completes
  workdir: str  # weights, server logs, caches go under it
  batch_rows: int  # learner rows per step (servers batch at least this many)
  task: Any = None  # the job's tasks.Task (multi-turn backends take its tool environment from it)


class RolloutBackend(abc.ABC):
  """Produces completed, scored groups for each learner version and takes each new version's weights.

  Call order: load_state_dict (on resume) -> start(v0, params) -> [next_groups(v) -> publish(v + 1, params)]*
  -> close(). close() must be safe after a failed or partial start (it runs in the loop's `finally`).
  """

  @abc.abstractmethod
  async def start(self, version: int, params: Any) -> None:
    """Brings rollouts up serving learner version `version` with these (host) params."""

  @abc.abstractmethod
  async def next_groups(self, version: int) -> list[Group]:
    """rl.prompts_per_step groups to train learner version `version` on: samples generated within the
    staleness bound, consumed (consumed_version, sample_lags set) and scored (rewards set)."""

  @abc.abstractmethod
  async def publish(self, version: int, params: Any) -> None:
    """Makes learner version `version` the one new generation uses. It may return before the version is live
    (it then runs in the background: the next publish, or wait_published, waits for it and raises its error);
    the params may be donated to the next learner step as soon as it returns."""

  async def wait_published(self) -> None:
    """Waits for a publish still running in the background; raises its error (e.g. PublishError)."""

  def last_publish_seconds(self) -> Optional[float]:
    """How long the latest background publish took (None: publish() does all its work before returning)."""
    return None

  def stats(self) -> dict[str, float]:
    """Flat numeric metrics logged with every step (TensorBoard names)."""
    return {}

  def state_dict(self) -> dict:
    """JSON-able state saved in each checkpoint, taken at the same moment as the prompt iterator's."""
    return {}

  def load_state_dict(self, state: dict) -> None:
    """Restores state_dict() output; called before start()."""

  async def close(self) -> None:
    """Stops generation and frees servers, tasks and connections."""


BackendFactory = Callable[[ml_collections.ConfigDict, RolloutContext], RolloutBackend]
ConfigT = TypeVar("ConfigT")


def config_field(section: str, default: Any = dataclasses.MISSING) -> Any:
  """A field of a backend's typed config, read from `config.<section>.<the field's name>` ('' = the top
  level); a field with a default may be absent from the config."""
  return dataclasses.field(default=default, metadata={"section": section})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingFields:
  """The fields every backend's typed config shares (it subclasses this): the job's seed and how a step's
  groups are sampled and filtered."""
  seed: int = config_field("")  # each sample's sampling_seed derives from it
  max_new_tokens: int = config_field("rl")
  temperature: float = config_field("rl")
  group_size: int = config_field("rl")
  prompts_per_step: int = config_field("rl")
  max_lag: int = config_field("rl")
  dynamic_sampling: Optional[dict[str, Any]] = config_field("rl", None)  # the group filter's section


def read_config(config_cls: type[ConfigT], config: ml_collections.ConfigDict) -> ConfigT:
  """The one place a backend's typed config is built: each field from its section, under its own name."""
  values = {}
  for f in dataclasses.fields(config_cls):
    section = f.metadata["section"]
    node = config
    for part in filter(None, section.split(".")):
      node = node.get(part) if node is not None else None
    if node is not None and f.name in node:
      value = node[f.name]
      values[f.name] = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    elif f.default is dataclasses.MISSING:
      where = f"{section}.{f.name}" if section else f.name
      raise ValueError(f"invalid config: {where} is missing ({config_cls.__name__} reads it)")
  return config_cls(**values)

# What a backend needs from the loop and the launcher; they read these facts and never test a mode's name.
BACKEND_FACTS = {
    "host_params": "takes the learner's params as host numpy arrays (an in-process backend keeps host copies); "
                   "otherwise it gets the sharded device arrays and exports them itself",
    "embedded_servers": "starts embedded SGLang-protocol server processes unless rollout.server_urls is set "
                        "(the job plans devices for them before the learner takes its own)",
    "adapters": "with model.lora, takes the adapter alone (its servers apply it to the base they serve) rather "
                "than full weights with the adapter merged in",
}
# rl.mode -> backend factory (config, ctx) -> RolloutBackend. A new backend is one module and one line here;
# implementations are imported when chosen (the HTTP stack is not loaded for the emulator).
BACKENDS = registry.Registry("rollout backend", facts=BACKEND_FACTS)
# SGLang-protocol servers: embedded ones the job starts, or rollout.server_urls (real SGLang).
BACKENDS.register_lazy("http", "vcpo_jax.rollout.http_backend:HttpBackend.from_config", embedded_servers=True,
                       adapters=True)
# The deterministic in-process lag emulator (rollouts for step t from the params of step t - k).
BACKENDS.register_lazy("emulate", "vcpo_jax.rollout.emulation.emulator:EmulatedBackend.from_config", host_params=True)
RENAMED_MODES = {"async": "http"}


def backend_entry(mode: str) -> registry.Entry:
  """The registered backend of rl.mode; an old or unknown name is an error naming the field and value."""
  if mode in RENAMED_MODES:
    raise ValueError(f"invalid config: rl.mode={mode!r} was renamed {RENAMED_MODES[mode]!r}; "
                     f"use --config.rl.mode={RENAMED_MODES[mode]}")
  if mode not in BACKENDS:
    raise ValueError(f"invalid config: rl.mode={mode!r}: must be one of {BACKENDS.names()}")
  return BACKENDS.get(mode)


def needs(config: ml_collections.ConfigDict, fact: str) -> bool:
  """Whether the configured backend declares `fact` (BACKEND_FACTS)."""
  return backend_entry(config.rl.mode).fact(fact)


def make_backend(config: ml_collections.ConfigDict, ctx: RolloutContext) -> RolloutBackend:
  return backend_entry(config.rl.mode).fn(config, ctx)
