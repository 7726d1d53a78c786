"""The SFT warm start the RL phase starts from (cached in workdir/base with the settings that made it)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import jax.numpy as jnp

from vcpo_jax.job import data
from vcpo_jax.job.configuration import build_optimizer, build_task, validate_config
from vcpo_jax.job.evaluation import evaluate
from vcpo_jax.job.warm_start_cache import changed_evaluation, check_cached_weights, warm_start_settings
from vcpo_jax.learner import train_state
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from vcpo_jax.model import tokenizer as tokenizer_lib


def starting_point(config):
  """(model_cfg, tokenizer, task, eval_examples) the job starts from: validated config; the pretrained
  checkpoint's tokenizer with model.hf_path, else ours; prompts in that tokenizer's chat template (a file-backed
  task's rows too long for the context dropped). The job and
  export_base both call this, so servers started on export_base's weights start on the job's own."""
  model_cfg = validate_config(config, with_task=False)  # the task is built (its files read) once, here
  tok = tokenizer_lib.for_model(config.model.get("hf_path", ""))
  task = build_task(config, render_prompt=tok.chat_prompt)
  task.fit_context(tok, model_cfg.max_seq_len, config.rl.max_new_tokens)  # files: too-long rows skipped, logged
  eval_examples = task.eval_set(config.task.eval_size, seed=config.seed)
  return model_cfg, tok, task, eval_examples


def warm_start(config, workdir: str, model_cfg, tok, task, eval_examples, rewarder) -> tuple[str, dict]:
  """SFT on deliberately imperfect solutions; the result is cached as a HF directory in workdir/base, with the
  settings that made it: a rerun under other weight settings is refused, one under other evaluation settings
  re-evaluates the cached weights (caches without that record are trusted)."""
  base_dir = os.path.join(workdir, "base")
  info_path = os.path.join(base_dir, "warm_start.json")
  settings_path = os.path.join(base_dir, "warm_start_settings.json")
  if os.path.exists(info_path):
    return base_dir, _cached(config, base_dir, model_cfg, tok, task, eval_examples, rewarder)
  optimizer = build_optimizer(config, sft=True)
  # The warm start makes the base: full fine-tuning with or without model.lora (which applies to RL only).
  model_cfg = dataclasses.replace(model_cfg, lora=model_config.LoraConfig())
  state = train_state.create_train_state(model_cfg, optimizer, jax.random.PRNGKey(config.seed))
  if config.model.get("hf_path", ""):  # start from the checkpoint, each parameter read into its sharding
    state = train_state.with_params(state, hf.import_hf(config.model.hf_path, cfg=model_cfg, shardings=jax.tree.map(
        lambda x: x.sharding, state.params))[0])
  sft_step = train_state.make_sft_step(model_cfg, optimizer)
  it = data.make_sft_iterator(task, tok, seed=config.seed, batch_size=config.sft.batch_size,
                              seq_len=model_cfg.max_seq_len, error_rate=config.sft.error_rate,
                              shard_index=0, shard_count=1)  # one process warm-starts (train._warm_start_once)
  t0 = time.time()
  sft_metrics = {}
  for step in range(config.sft.steps):
    batch = next(it)
    state, sft_metrics = sft_step(state, jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"]))
    if step % 50 == 0 or step == config.sft.steps - 1:
      logging.info("sft step %d/%d loss %.4f", step + 1, config.sft.steps, float(sft_metrics["loss"]))
  params = jax.device_get(state.params)
  info = evaluate_as_job(config, params, model_cfg, tok, task, eval_examples, rewarder)
  info.update({"sft/steps": config.sft.steps, "sft/seconds": time.time() - t0,
               "sft/final_loss": float(sft_metrics.get("loss", float("nan")))})
  # Write the directory, then the marker inside it: a crash in between leaves no marker and reruns SFT.
  hf_export.export_hf(params, model_cfg, base_dir, tok)
  _write_json(settings_path, warm_start_settings(config))
  _write_json(info_path, info)
  logging.info("warm start done: %s", info)
  return base_dir, info


def _cached(config, base_dir, model_cfg, tok, task, eval_examples, rewarder) -> dict:
  """The cached warm start's info. Refused if its weights came from other settings; if only the evaluation
  settings changed, its weights are kept and evaluated as this run asks, and the new settings recorded."""
  info_path = os.path.join(base_dir, "warm_start.json")
  settings_path = os.path.join(base_dir, "warm_start_settings.json")
  with open(info_path) as f:
    info = json.load(f)
  if not os.path.exists(settings_path):
    return info
  with open(settings_path) as f:
    cached = json.load(f)
  asked = warm_start_settings(config)
  check_cached_weights(cached, asked, settings_path)
  changed = changed_evaluation(cached, asked)
  if not changed:
    return info
  logging.info("warm start: re-evaluating the cached base model (%s)",
               ", ".join(f"{f} {old!r} -> {new!r}" for f, (old, new) in changed.items()))
  params, _ = hf.import_hf(base_dir, cfg=model_cfg)
  info = {**{k: v for k, v in info.items() if not k.startswith("eval/")},
          **evaluate_as_job(config, params, model_cfg, tok, task, eval_examples, rewarder)}
  # The accuracy first, then the settings it was measured under: a crash in between only evaluates again.
  _write_json(info_path, info)
  _write_json(settings_path, asked)
  return info


def _write_json(path: str, data: dict) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=2)
  os.replace(path + ".tmp", path)


def evaluate_as_job(config, params, model_cfg, tok, task, eval_examples, rewarder) -> dict:
  """Held-out accuracy as every evaluation of the job measures it (budget, seed, draws per problem)."""
  return evaluate(params, model_cfg, tok, task, eval_examples, rewarder=rewarder,
                  max_new_tokens=config.rl.max_new_tokens,
                  seed=config.seed, samples=config.task.get("eval_samples", 1))
