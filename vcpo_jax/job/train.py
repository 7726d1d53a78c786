"""The RL job: validate config, SFT warm start (job/warm_start.py), then one RL loop over a rollout backend."""
from __future__ import annotations

import json
import logging
import os

import jax
import ml_collections
import numpy as np

from vcpo_jax.job import batching
from vcpo_jax.job import checkpointing
from vcpo_jax.job import data
from vcpo_jax.job import metrics as metrics_lib
from vcpo_jax.job import multihost
from vcpo_jax.job.loop import rl_loop, run_rl_loop  # noqa: F401  (rl_loop: callers drive it as train.rl_loop)
from vcpo_jax.job import configuration
from vcpo_jax.job.configuration import build_optimizer, learner_config
from vcpo_jax.job.warm_start import evaluate_as_job, starting_point, warm_start
from vcpo_jax.learner import step as learner
from vcpo_jax.learner import train_state
from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.model import hf, peft_export
from vcpo_jax.parallel import processes
from vcpo_jax.parallel import sharding
from vcpo_jax.rollout import backend as backend_lib, group_metrics
from vcpo_jax.rollout.rewards import Rewarder


# Metrics that are NaN by definition on some steps (no group with reward variance has an OPOB ratio).
UNDEFINED_OK = ("opob/moment_ratio",)


# ------------------------------------------------------------------------------------------ RL loop
def due(step: int, every: int, last_step: int) -> bool:
  """Whether a periodic action (eval_every, checkpoint_every, log_every) runs after `step`: every `every`
  steps and always after the last one; every = 0 means only after the last one."""
  return step == last_step or (every > 0 and step % every == 0)


class RLRun:
  """Learner-side state of the RL phase and everything done between two learner steps."""

  def __init__(self, config, workdir: str, model_cfg, tok, task, base_dir: str, eval_examples, base_info,
               rewarder: Rewarder):
    self.config, self.workdir, self.model_cfg = config, workdir, model_cfg
    self.rewarder = rewarder  # the task's reward and its pool: rollouts and evaluations score with it
    self._reward_counts = rewarder.stats()  # logged per step: the calls and errors since the previous step
    self.tok, self.task, self.eval_examples, self.base_info = tok, task, eval_examples, base_info
    rl = config.rl
    # Many hosts: process 0 (the leader) alone drives rollouts, data, evaluation and files (multihost.py).
    self.leader, self.timeout_s = processes.is_leader(), _distributed_timeout(config)
    self.mesh = sharding.make_mesh(config.mesh)
    # Rows are split over data x fsdp; invalid padding rows fill the batch up to a multiple of that.
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    self.batch_rows = -(-rl.prompts_per_step * rl.group_size // shards) * shards
    self.optimizer = build_optimizer(config)
    self.learner_cfg = learner_config(config)
    self.layout = batching.BatchLayout(
        seq_len=model_cfg.max_seq_len, pad_id=tok.pad_id, num_rows=self.batch_rows,
        vocab_size=model_cfg.vocab_size, mesh=self.mesh, micro_batch_size=self.learner_cfg.micro_batch_size,
        timeout_s=self.timeout_s, shaping=configuration.overlong_shaping(config))
    self.step_fn = learner.make_rl_step(model_cfg, self.learner_cfg, self.optimizer, mesh=self.mesh)
    state = train_state.create_train_state(model_cfg, self.optimizer, jax.random.PRNGKey(config.seed),
                                       mesh=self.mesh)
    # Each parameter is read from disk straight into its sharding (no whole-model host copy).
    base_params, _ = hf.import_hf(base_dir, cfg=model_cfg, shardings=jax.tree.map(
        lambda x: x.sharding, train_state.base_params(state)))
    self.state = train_state.with_params(state, base_params)  # with model.lora: the frozen base
    # The frozen warm-start policy is the KL reference (checkpointed with the state; with LoRA the base itself).
    if config.algo.kl_beta > 0:
      self.state = train_state.with_reference(self.state)
    self.prompts = data.make_prompt_iterator(task, seed=config.seed, tokenizer=tok, shard_index=0,
                                             shard_count=1) if self.leader else None
    self.ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
    self.writer = metrics_lib.MetricsWriter(os.path.join(workdir, "tensorboard"),
                                            enabled=jax.process_index() == 0)
    self.step, self.rollout_state = 0, {}
    restored = self.ckpt.restore(checkpointing.abstract_like(self.state))
    if restored is not None:
      self.step, self.state, host = restored
      if self.leader:
        self.prompts.set_state(host["data"])
      # Older checkpoints kept the scheduler's state at the top level.
      self.rollout_state = host.get("rollout", {"scheduler": host["scheduler"]} if "scheduler" in host else {})
      logging.info("resumed from checkpoint at step %d", self.step)
    else:
      self.writer.write(0, base_info, prefix="")
    self.progress = metrics_lib.Progress(rl.steps, initial=self.step,
                                         enabled=self.leader and os.environ.get("VCPO_PROGRESS", "1") != "0")
    self.consumed_log = os.path.join(workdir, "consumed.jsonl")
    self.scalars_log = os.path.join(workdir, "metrics.jsonl")
    self.last_eval: dict = {}
    self.eval_step = -1  # learner version last evaluated (every process knows it)

  def rollout_context(self) -> backend_lib.RolloutContext:
    return backend_lib.RolloutContext(
        model_cfg=self.model_cfg, tokenizer=self.tok, prompts=self.prompts,
        rewarder=self.rewarder, workdir=self.workdir, batch_rows=self.batch_rows,
        task=self.task)

  def make_backend(self) -> backend_lib.RolloutBackend:
    if not processes.multi_process():
      return backend_lib.make_backend(self.config, self.rollout_context())
    if not self.leader:
      return multihost.FollowerBackend(self.timeout_s)
    return multihost.LeaderBackend(backend_lib.make_backend(self.config, self.rollout_context()),
                                   host_params=_host_params(self.config))

  def rollout_params(self):
    """What start/publish get: host copies for in-process backends (the emulator keeps k + 1 of them), the
    sharded params for server backends (their export gathers one tensor at a time). Several processes: the
    sharded params always (multihost.LeaderBackend makes the host copies, gathering with the followers).
    With model.lora: the adapter alone for a backend whose servers apply it (the http backend: docs/lora.md),
    else full weights with the adapter merged in (the emulator)."""
    if self.model_cfg.lora.rank and backend_lib.needs(self.config, "adapters"):
      return self.state.params
    params = train_state.policy_params(self.state, self.model_cfg)
    if _host_params(self.config) and not processes.multi_process():
      return jax.device_get(params)
    return params

  def host_params(self, name: str):
    """The params on the leader's host (None on the other processes, which join the gathers)."""
    return processes.host_tree(train_state.policy_params(self.state, self.model_cfg), f"{name}/{self.step}",
                               self.timeout_s)

  def learn(self, batch: RLBatch) -> dict:
    """One learner step (blocking; the loop runs it in a worker thread while rollouts go on)."""
    self.state, step_metrics = self.step_fn(self.state, batch)
    return jax.device_get(step_metrics)

  def after_step(self, groups, step_metrics: dict, extra: dict, seconds: float, rollout_state_fn):
    """Logging, periodic evaluation and checkpointing once learner version self.step exists."""
    self.step += 1
    rl = self.config.rl
    eval_now = due(self.step, self.config.eval_every, rl.steps)
    if eval_now:
      self.eval_step = self.step
    if not self.leader:  # followers: the gathers of the evaluation, the checkpoint (a collective save)
      if eval_now:
        self.host_params("eval")
      if due(self.step, self.config.checkpoint_every, rl.steps):
        self.ckpt.save(self.step, self.state, {"step": self.step})  # the leader's JSON is the one written
      return
    with open(self.consumed_log, "a") as f:
      f.write(json.dumps({"step": self.step, "indices": [g.index for g in groups]}) + "\n")
    scalars = {**step_metrics, **group_metrics.step_metrics(groups, seconds=seconds, max_lag=rl.get("max_lag"),
                                                                        shaping=self.layout.shaping),
               **extra, **self._reward_counts_since_last_step()}
    for key, value in step_metrics.items():
      arr = np.asarray(value)
      if arr.ndim == 0 and not np.isfinite(arr) and not key.startswith("hist/") and key not in UNDEFINED_OK:
        logging.warning("step %d: metric %s is not finite (%s)", self.step, key, arr)
    if eval_now:
      self.last_eval = evaluate_as_job(self.config, self.host_params("eval"), self.model_cfg, self.tok, self.task,
                                       self.eval_examples, self.rewarder)
      scalars.update(self.last_eval)
      logging.info("step %d eval %s", self.step, self.last_eval)
    if due(self.step, self.config.log_every, rl.steps) or eval_now:
      self.writer.write(self.step, scalars)
    host_scalars = metrics_lib.split_metrics(scalars)[0]
    with open(self.scalars_log, "a") as f:
      f.write(json.dumps({"step": self.step, **host_scalars}) + "\n")
    self.progress.update(self.step, host_scalars)
    if due(self.step, self.config.checkpoint_every, rl.steps):
      host = {"data": self.prompts.get_state(), "step": self.step, "rollout": rollout_state_fn()}
      if not self.ckpt.save(self.step, self.state, host):
        self.writer.write(self.step, {"checkpoint/failed_saves": self.ckpt.failed_saves})

  def _reward_counts_since_last_step(self) -> dict[str, float]:
    """reward/calls and reward/errors/<kind> of this step (its rollouts and the evaluation before it)."""
    now = self.rewarder.stats()
    out = {k: v - self._reward_counts.get(k, 0.0) for k, v in now.items()}
    self._reward_counts = now
    return out

  def write_adapter(self, base_dir: str):
    """With model.lora: the trained adapter as a PEFT directory, workdir/adapter (every process joins the
    gather; the leader writes)."""
    adapter = processes.host_tree(self.state.params, f"adapter/{self.step}", self.timeout_s)
    if self.leader:
      out = peft_export.write_adapter(adapter, self.model_cfg, None, os.path.join(self.workdir, "adapter"),
                                      dtype="float32", base_model=os.path.abspath(base_dir))
      logging.info("adapter at step %d written to %s (PEFT LoRA)", self.step, out)

  def close(self):
    self.progress.close()
    self.writer.close()
    self.ckpt.close()


def _distributed_timeout(config) -> float:
  d = config.get("distributed")
  return float(d.timeout_s) if d is not None else 1800.0


def _host_params(config) -> bool:
  """Whether the backend takes host copies of the params (its declared need) rather than sharded arrays."""
  return backend_lib.needs(config, "host_params")


def _warm_start_once(config, workdir, model_cfg, tok, task, eval_examples, rewarder):
  """The leader warm-starts (or finds the cached result); the other processes wait, then read its cache."""
  if processes.is_leader():
    out = warm_start(config, workdir, model_cfg, tok, task, eval_examples, rewarder)
  processes.barrier("warm_start", _distributed_timeout(config))
  if not processes.is_leader():
    out = warm_start(config, workdir, model_cfg, tok, task, eval_examples, rewarder)  # cached by now
  return out


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs (or resumes) the whole job; returns the base and final evaluation metrics."""
  model_cfg, tok, task, eval_examples = starting_point(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  leader = processes.is_leader()
  if leader:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  rewarder = Rewarder.for_task(task, tok, configuration.reward_config(config))  # the one reward object of the job
  try:
    base_dir, base_info = _warm_start_once(config, workdir, model_cfg, tok, task, eval_examples, rewarder)
    logging.info("base model: greedy accuracy %.3f, sampled accuracy %.3f",
                 base_info["eval/greedy_accuracy"], base_info["eval/sampled_accuracy"])
    run = RLRun(config, workdir, model_cfg, tok, task, base_dir, eval_examples, base_info, rewarder)
    try:
      run_rl_loop(run)
      if model_cfg.lora.rank:
        run.write_adapter(base_dir)
    finally:
      run.close()
    final = run.last_eval
    if run.eval_step != run.step:  # resumed after the last step: evaluate here (the others join the gathers)
      params = run.host_params("final")
      final = evaluate_as_job(config, params, model_cfg, tok, task, eval_examples, rewarder) if leader else {}
  finally:
    rewarder.close()
  result = {"base": {k: base_info[k] for k in base_info if k.startswith("eval/")}, "final": final,
            "steps": run.step}
  if leader:
    with open(os.path.join(workdir, "result.json"), "w") as f:
      json.dump(result, f, indent=2)
  logging.info("done: %s", result)
  return result
