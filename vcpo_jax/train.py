"""The RL job: validate config, SFT warm start (cached), then async VCPO with rollouts, eval, checkpoints."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vcpo_jax import checkpointing, data, hf, learner, losses, metrics as metrics_lib, model as model_lib
from vcpo_jax import optimizer as optimizer_lib, sampling, sharding, tasks, tokenizer as tokenizer_lib
from vcpo_jax.configuration import MODES, build_optimizer, learner_config, validate_config  # noqa: F401
from vcpo_jax.rollout import batching, emulation, launcher, scheduler as scheduler_lib


# --------------------------------------------------------------------------------------- evaluation
def completion_text(tok, ids) -> str:
  """Response text for the reward: special tokens dropped; ids of the model's padded vocabulary rows that
  the tokenizer lacks become U+FFFD, which no task accepts (so they score 0 instead of crashing)."""
  out, run = [], []
  for i in ids:
    i = int(i)
    if i in tok.special_ids:
      continue
    if 0 <= i < tok.vocab_size:
      run.append(i)
      continue
    out.append(tok.decode(run) + "\ufffd")
    run = []
  return "".join(out) + tok.decode(run)


def evaluate(params, model_cfg, tok, task, examples, *, max_new_tokens: int, seed: int) -> dict[str, float]:
  """Greedy and sampled (temperature 1) accuracy on held-out examples, generated in-process."""
  prompts = [tok.encode(e["prompt"]) for e in examples]
  out = {}
  for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
    results = sampling.generate(params, model_cfg, prompts, max_new_tokens=max_new_tokens,
                                temperature=temperature, stop_token_ids=tok.stop_ids, rng=seed)
    rewards = [task.reward(e, completion_text(tok, r.output_ids)) for e, r in zip(examples, results)]
    out[f"eval/{name}_accuracy"] = float(np.mean(rewards))
  return out


# --------------------------------------------------------------------------------------- warm start
def warm_start(config, workdir: str, model_cfg, tok, task, eval_examples) -> tuple[str, dict]:
  """SFT on deliberately imperfect solutions; the result is cached as a HF directory in workdir/base."""
  base_dir = os.path.join(workdir, "base")
  info_path = os.path.join(base_dir, "warm_start.json")
  if os.path.exists(info_path):
    with open(info_path) as f:
      return base_dir, json.load(f)
  optimizer = build_optimizer(config, sft=True)
  state = learner.create_train_state(model_cfg, optimizer, jax.random.PRNGKey(config.seed))
  sft_step = learner.make_sft_step(model_cfg, optimizer)
  it = data.make_sft_iterator(task, tok, seed=config.seed, batch_size=config.sft.batch_size,
                              seq_len=model_cfg.max_seq_len, error_rate=config.sft.error_rate)
  t0 = time.time()
  sft_metrics = {}
  for step in range(config.sft.steps):
    batch = next(it)
    state, sft_metrics = sft_step(state, jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"]))
    if step % 50 == 0 or step == config.sft.steps - 1:
      logging.info("sft step %d/%d loss %.4f", step + 1, config.sft.steps, float(sft_metrics["loss"]))
  params = jax.device_get(state.params)
  info = evaluate(params, model_cfg, tok, task, eval_examples, max_new_tokens=config.rl.max_new_tokens,
                  seed=config.seed)
  info.update({"sft/steps": config.sft.steps, "sft/seconds": time.time() - t0,
               "sft/final_loss": float(sft_metrics.get("loss", float("nan")))})
  # Write the directory, then the marker inside it: a crash in between leaves no marker and reruns SFT.
  hf.export_hf(params, model_cfg, base_dir, tok)
  with open(info_path + ".tmp", "w") as f:
    json.dump(info, f, indent=2)
  os.replace(info_path + ".tmp", info_path)
  logging.info("warm start done: %s", info)
  return base_dir, info


# ------------------------------------------------------------------------------------------ RL loop
class RLRun:
  """Learner-side state of the RL phase and everything done between two learner steps."""

  def __init__(self, config, workdir: str, model_cfg, tok, task, base_dir: str, eval_examples, base_info):
    self.config, self.workdir, self.model_cfg = config, workdir, model_cfg
    self.tok, self.task, self.eval_examples, self.base_info = tok, task, eval_examples, base_info
    rl = config.rl
    self.mesh = sharding.make_mesh(config.mesh)
    # Rows are split over data x fsdp; invalid padding rows fill the batch up to a multiple of that.
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    self.batch_rows = -(-rl.prompts_per_step * rl.group_size // shards) * shards
    self.optimizer = build_optimizer(config)
    self.step_fn = learner.make_rl_step(model_cfg, learner_config(config), self.optimizer, mesh=self.mesh)
    base_params, _ = hf.import_hf(base_dir)
    state = learner.create_train_state(model_cfg, self.optimizer, jax.random.PRNGKey(config.seed),
                                       mesh=self.mesh)
    self.state = state.replace(params=jax.tree_util.tree_map(
        lambda x, like: jax.device_put(jnp.asarray(x, like.dtype), like.sharding), base_params, state.params))
    self.prompts = data.make_prompt_iterator(task, seed=config.seed, tokenizer=tok)
    self.ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
    self.writer = metrics_lib.MetricsWriter(os.path.join(workdir, "tensorboard"),
                                            enabled=jax.process_index() == 0)
    self.step, self.scheduler_state = 0, None
    restored = self.ckpt.restore(checkpointing.abstract_like(self.state))
    if restored is not None:
      self.step, self.state, host = restored
      self.prompts.set_state(host["data"])
      self.scheduler_state = host.get("scheduler")
      logging.info("resumed from checkpoint at step %d", self.step)
    else:
      self.writer.write(0, base_info, prefix="")
    self.progress = metrics_lib.Progress(rl.steps, initial=self.step,
                                         enabled=os.environ.get("VCPO_PROGRESS", "1") != "0")
    self.consumed_log = os.path.join(workdir, "consumed.jsonl")
    self.scalars_log = os.path.join(workdir, "metrics.jsonl")
    self.last_eval: dict = {}

  @property
  def seq_len(self) -> int:
    return self.model_cfg.max_seq_len

  def sampling_params(self) -> dict:
    rl = self.config.rl
    return {"max_new_tokens": rl.max_new_tokens, "temperature": rl.temperature,
            "stop_token_ids": list(self.tok.stop_ids), "no_stop_trim": True,
            "sampling_seed": self.config.seed}

  def to_arrays(self, groups) -> batching.RolloutArrays:
    return batching.groups_to_arrays(
        groups, seq_len=self.seq_len, pad_id=self.tok.pad_id, num_rows=self.batch_rows,
        vocab_size=self.model_cfg.vocab_size,
        decode=lambda ids: completion_text(self.tok, ids),
        reward_fn=self.task.reward)

  def learn(self, arrays: batching.RolloutArrays) -> dict:
    """One learner step (blocking; the async loop runs it in a worker thread)."""
    batch = learner.RLBatch(
        tokens_BxT=arrays.tokens_BxT, mask_BxT=arrays.mask_BxT, sampler_logp_BxT=arrays.sampler_logp_BxT,
        rewards_B=arrays.rewards_B, group_B=arrays.group_B, lag_B=arrays.lag_B.astype(np.float32),
        valid_B=arrays.valid_B)
    self.state, step_metrics = self.step_fn(self.state, batch)
    return jax.device_get(step_metrics)

  def host_metrics(self, arrays: batching.RolloutArrays, seconds: float) -> dict:
    valid = arrays.valid_B > 0
    lengths = arrays.mask_BxT.sum(axis=1)[valid]
    return {"reward/mean": float(arrays.rewards_B[valid].mean()),
            "reward/std": float(arrays.rewards_B[valid].std()),
            "response_length/mean": float(lengths.mean()),
            "throughput/tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
            "throughput/step_seconds": seconds}

  def after_step(self, arrays, step_metrics: dict, extra: dict, seconds: float, host_state_fn):
    """Logging, periodic evaluation and checkpointing once learner version self.step exists."""
    self.step += 1
    with open(self.consumed_log, "a") as f:
      f.write(json.dumps({"step": self.step, "indices": arrays.indices}) + "\n")
    scalars = {**step_metrics, **self.host_metrics(arrays, seconds), **extra}
    for key, value in step_metrics.items():
      arr = np.asarray(value)
      if arr.ndim == 0 and not np.isfinite(arr) and not key.startswith("hist/"):
        logging.warning("step %d: metric %s is not finite (%s)", self.step, key, arr)
    rl = self.config.rl
    eval_now = self.step % self.config.eval_every == 0 or self.step == rl.steps
    if eval_now:
      self.last_eval = evaluate(jax.device_get(self.state.params), self.model_cfg, self.tok, self.task,
                                self.eval_examples, max_new_tokens=rl.max_new_tokens, seed=self.config.seed)
      scalars.update(self.last_eval)
      logging.info("step %d eval %s", self.step, self.last_eval)
    if self.step % self.config.log_every == 0 or eval_now:
      self.writer.write(self.step, scalars)
    host_scalars = metrics_lib.split_metrics(scalars)[0]
    with open(self.scalars_log, "a") as f:
      f.write(json.dumps({"step": self.step, **host_scalars}) + "\n")
    self.progress.update(self.step, host_scalars)
    if self.step % self.config.checkpoint_every == 0 or self.step == rl.steps:
      host = {"data": self.prompts.get_state(), "step": self.step, **host_state_fn()}
      if not self.ckpt.save(self.step, self.state, host):
        self.writer.write(self.step, {"checkpoint/failed_saves": self.ckpt.failed_saves})

  def close(self):
    self.progress.close()
    self.writer.close()
    self.ckpt.close()


def _client_metrics(stats: dict) -> dict:
  """Numeric rollout stats as flat TensorBoard names (server URLs become legal name parts)."""
  out = {}
  for key, value in stats.items():
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      out[f"rollout/{key}"] = float(value)
    elif isinstance(value, dict):
      for sub, v in value.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
          out[f"rollout/{key}/{re.sub(r'[^A-Za-z0-9_.-]+', '_', str(sub))}"] = float(v)
  return out


async def _async_rl(run: RLRun):
  """Servers generate with version v while the learner computes v+1; the scheduler enforces lag <= k."""
  from vcpo_jax.rollout import client as client_lib, publisher as publisher_lib  # noqa: PLC0415
  config = run.config
  weights_root = os.path.join(run.workdir, "weights")
  os.makedirs(weights_root, exist_ok=True)
  export = lambda params, out_dir: hf.export_hf(params, run.model_cfg, out_dir, run.tok)  # noqa: E731
  servers = []
  if config.rollout.server_urls:  # their starting weights are published below, once the client is up
    urls = [u.strip() for u in config.rollout.server_urls.split(",") if u.strip()]
  else:  # embedded servers start directly from the current version's directory
    first_dir = os.path.join(weights_root, f"v{run.step}")
    await asyncio.to_thread(export, jax.device_get(run.state.params), first_dir)
    servers = await asyncio.to_thread(
        launcher.start_servers, config.rollout.num_servers, first_dir, weights_root=weights_root,
        base_port=config.rollout.base_port, log_dir=os.path.join(run.workdir, "logs"),
        weight_version=f"v{run.step}",
        extra_args=("--max-batch", str(max(64, run.batch_rows)),
                    "--compilation-cache-dir", os.path.join(run.workdir, "jax_cache")))
    urls = [s.url for s in servers]
  client = client_lib.RolloutClient(urls, vocab_size=run.model_cfg.vocab_size,
                                    request_timeout=config.rollout.request_timeout,
                                    max_retries=config.rollout.max_retries)
  sched = publisher = None
  try:
    await client.start()
    publisher = publisher_lib.WeightPublisher(export, weights_root, client, keep_last=config.rollout.keep_versions)
    if config.rollout.server_urls:  # external servers: load the starting weights explicitly
      await publisher.publish(jax.device_get(run.state.params), run.step)
    sched = scheduler_lib.RolloutScheduler(
        client.generate, run.prompts, sampling_params=run.sampling_params(), group_size=config.rl.group_size,
        batch_groups=config.rl.prompts_per_step, max_lag=config.rl.max_lag)
    if run.scheduler_state is not None:
      sched.load_state_dict(run.scheduler_state)
    while run.step < config.rl.steps:
      t0 = time.perf_counter()
      groups = await sched.next_batch(run.step)
      arrays = run.to_arrays(groups)
      step_metrics = await asyncio.to_thread(run.learn, arrays)
      await publisher.publish(jax.device_get(run.state.params), run.step + 1)
      extra = {**_client_metrics(client.stats), **_client_metrics(sched.stats)}
      run.after_step(arrays, step_metrics, extra, time.perf_counter() - t0,
                     lambda: {"scheduler": sched.state_dict()})
  finally:
    if sched is not None:
      await sched.close()
    if publisher is not None:
      await publisher.close()
    await client.close()
    launcher.stop_servers(servers)


def _emulated_rl(run: RLRun):
  """Deterministic in-process lag emulation: step t trains on rollouts of the params of step t - k."""
  config = run.config
  emulator = emulation.LagEmulator(
      generate=lambda params, prompts, seeds: sampling.generate(
          params, run.model_cfg, prompts, max_new_tokens=config.rl.max_new_tokens,
          temperature=config.rl.temperature, stop_token_ids=run.tok.stop_ids, seeds=seeds),
      max_lag=config.rl.max_lag, group_size=config.rl.group_size, seed=config.seed)
  # The ring buffer is not checkpointed (k+1 copies of the params): after a resume the lag ramps up again.
  emulator.push(run.step, jax.device_get(run.state.params))
  while run.step < config.rl.steps:
    t0 = time.perf_counter()
    examples = [next(run.prompts) for _ in range(config.rl.prompts_per_step)]
    groups = emulator.rollout(run.step, examples)
    arrays = run.to_arrays(groups)
    step_metrics = run.learn(arrays)
    emulator.push(run.step + 1, jax.device_get(run.state.params))
    run.after_step(arrays, step_metrics, {}, time.perf_counter() - t0, dict)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs (or resumes) the whole job; returns the base and final evaluation metrics."""
  model_cfg = validate_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  tok = tokenizer_lib.build_tokenizer()
  task = tasks.get_task(config.task.name, **config.task.kwargs)
  eval_examples = task.eval_set(config.task.eval_size, seed=config.seed)
  base_dir, base_info = warm_start(config, workdir, model_cfg, tok, task, eval_examples)
  logging.info("base model: greedy accuracy %.3f, sampled accuracy %.3f",
               base_info["eval/greedy_accuracy"], base_info["eval/sampled_accuracy"])
  run = RLRun(config, workdir, model_cfg, tok, task, base_dir, eval_examples, base_info)
  try:
    if config.rl.mode == "async":
      asyncio.run(_async_rl(run))
    else:
      _emulated_rl(run)
  finally:
    run.close()
  final = run.last_eval or evaluate(jax.device_get(run.state.params), model_cfg, tok, task, eval_examples,
                                    max_new_tokens=config.rl.max_new_tokens, seed=config.seed)
  result = {"base": {k: base_info[k] for k in base_info if k.startswith("eval/")}, "final": final,
            "steps": run.step}
  with open(os.path.join(workdir, "result.json"), "w") as f:
    json.dump(result, f, indent=2)
  logging.info("done: %s", result)
  return result
