"""Replays a lag-emulation run from one of its checkpoints: the learner's params and the batches it trains on next."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import ml_collections

from vcpo_jax.job import batching, checkpointing, data, warm_start
from vcpo_jax.job.configuration import build_optimizer, reward_config
from vcpo_jax.learner import train_state
from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.rollout import backend
from vcpo_jax.rollout.emulation import emulator, lag_model as lag_model_lib, ring_store
from vcpo_jax.rollout.rewards import Rewarder

# "run": the run's own rl.emulation.lag_model; "max": every group from version s - k (the lag bound). A lag
# model's name (lag_model.LAG_MODELS) replays with that one instead.
RUN, MAX = "run", "max"


class Run(NamedTuple):
  """A finished or running job, rebuilt from its WORKDIR/config.json."""
  config: ml_collections.ConfigDict
  model_cfg: Any  # model.ModelConfig
  tokenizer: Any
  task: Any  # tasks.Task: its reward_function() scores the replayed groups


@dataclasses.dataclass(frozen=True)
class Replay:
  """The checkpoint's learner params and the batches the emulator would hand the learner next, in order."""
  step: int
  params: Any
  model_cfg: Any
  config: ml_collections.ConfigDict
  batches: list[RLBatch]  # numpy rows, as job/batching.py builds them for the step


def load_run(workdir: str) -> Run:
  """The lag-emulation run in `workdir` (its config.json); another backend's run is an error (no past policies)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"workdir={workdir!r} has no config.json: not a vcpo_jax.main workdir")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  if config.rl.mode != "emulate":
    raise ValueError(f"{workdir}: rl.mode={config.rl.mode!r}; a replay needs a lag-emulation run (rl.mode=emulate), "
                     "whose past policy versions are saved with its checkpoints")
  model_cfg, tok, task, _ = warm_start.starting_point(config)
  return Run(config, model_cfg, tok, task)


def checkpoint_steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _restore(workdir: str, run: Run, step: int) -> tuple[Any, dict]:
  """(learner params at `step`, the checkpoint's host state: prompt iterator, the backend's ring versions)."""
  config = run.config
  state = train_state.create_train_state(run.model_cfg, build_optimizer(config), jax.random.PRNGKey(config.seed))
  if config.algo.kl_beta > 0:
    state = train_state.with_reference(state)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    _, state, host = ckpt.restore(checkpointing.abstract_like(state), step=step)
  finally:
    ckpt.close()
  return train_state.policy_params(state, run.model_cfg), host


def _lag_config(config: ml_collections.ConfigDict, lag: str) -> emulator.EmulatedBackendConfig:
  """The emulate backend's config with the replay's lag model (MAX: 'fixed', which at step s >= k is s - k)."""
  cfg = backend.read_config(emulator.EmulatedBackendConfig, config)
  if lag == RUN:
    return cfg
  name = "fixed" if lag == MAX else lag
  if name not in lag_model_lib.LAG_MODELS:
    raise ValueError(f"lag={lag!r}: must be {RUN!r}, {MAX!r} or a lag model ({list(lag_model_lib.LAG_MODELS)})")
  options = dict(cfg.emulation or {}) if name != "fixed" else {}
  return dataclasses.replace(cfg, emulation={**options, "lag_model": name})


def _check_ring(workdir: str, step: int, versions: list[int], max_lag: int) -> None:
  store = ring_store.RingStore(os.path.join(workdir, "emulation_ring"))
  missing = [v for v in versions if not os.path.exists(store.path(v))]
  if missing:
    have = sorted(int(f[1:-4]) for f in os.listdir(store.directory) if f.endswith(".npz") and f[1:-4].isdigit()) \
        if os.path.isdir(store.directory) else []
    raise LookupError(f"checkpoint step {step}: the sampler's params of version(s) {missing} are not in "
                      f"{store.directory} (it holds {have}: the emulator keeps only the latest checkpoints' "
                      f"{max_lag} past versions)")


def replay(workdir: str, step: int, batches: int, lag: str = RUN, run: Run | None = None) -> Replay:
  """The run's learner params at checkpoint `step` and the `batches` batches its emulator hands the learner
  next, as a resumed run would draw them (the checkpoint's prompt iterator and past versions, the emulator's
  seeds and lag model), scored by the task. `run`: load_run(workdir) already made (one per workdir suffices)."""
  run = run or load_run(workdir)
  if step not in checkpoint_steps(workdir):
    raise ValueError(f"step={step}: no checkpoint at that step in {workdir} (have {checkpoint_steps(workdir)})")
  if batches < 1:
    raise ValueError(f"batches={batches}: must be >= 1")
  config, model_cfg, tok = run.config, run.model_cfg, run.tokenizer
  cfg = _lag_config(config, lag)
  params, host = _restore(workdir, run, step)
  ring = [int(v) for v in host.get("rollout", {}).get("ring_versions", [])]
  _check_ring(workdir, step, ring, cfg.max_lag)
  prompts = data.make_prompt_iterator(run.task, seed=config.seed, tokenizer=tok, shard_index=0, shard_count=1)
  prompts.set_state(host["data"])
  rewarder = Rewarder.for_task(run.task, tok, reward_config(config))
  ctx = backend.RolloutContext(model_cfg=model_cfg, tokenizer=tok, prompts=prompts, rewarder=rewarder,
                               workdir=workdir, batch_rows=cfg.prompts_per_step * cfg.group_size, task=run.task)
  try:
    rollouts = emulator.EmulatedBackend.build(cfg, ctx)
    rollouts.load_state_dict(host.get("rollout", {}))  # as job/train.py resumes it: the ring, then the params
    asyncio.run(rollouts.start(step, params))
    out = [batching.groups_to_batch(asyncio.run(rollouts.next_groups(step)), seq_len=model_cfg.max_seq_len,
                                    pad_id=tok.pad_id, vocab_size=model_cfg.vocab_size) for _ in range(batches)]
  finally:
    rewarder.close()
  return Replay(step=step, params=params, model_cfg=model_cfg, config=config, batches=out)
