"""bf16 vs float32 log-prob mismatch on the main job's model after a short warm start (docs/gpu.md, Precision).

`python -m benchmarks.cpu.bf16_mismatch [--sft-steps N]`: warm-starts the main job's model (float32), samples
responses to Countdown prompts with the float32 sampler, then scores the same tokens several ways and prints
per-token |delta| and per-sequence |sum delta| (= |log w| at lag 0) against the float32 learner:
the bf16-compute learner, the bf16 sampler (KV-cache decode), the float32 sampler, bf16 vs bf16, and the same
with bf16 layers and a float32 LM head (model.head_dtype="float32", the head at "highest").
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None) -> dict:
  from configs import countdown
  from vcpo_jax.algo import diagnostics
  from vcpo_jax.job import configuration
  from vcpo_jax.job import data
  from vcpo_jax.learner import train_state
  from vcpo_jax.model import hf
  from vcpo_jax.model import sampling
  from vcpo_jax.model import tokenizer as tokenizer_lib
  from vcpo_jax.model import transformer as model_lib
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sft-steps", type=int, default=100)
  p.add_argument("--prompts", type=int, default=64)
  args = p.parse_args(argv)
  config = countdown.get_config()
  cfg32 = hf.model_config(config.model)
  cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
  cfg16h = dataclasses.replace(cfg16, head_dtype="float32", matmul_precision="highest")
  tok = tokenizer_lib.build_tokenizer()
  task = configuration.build_task(config)
  opt = configuration.build_optimizer(config, sft=True)
  state = train_state.create_train_state(cfg32, opt, jax.random.PRNGKey(0))
  step = train_state.make_sft_step(cfg32, opt)
  it = data.make_sft_iterator(task, tok, seed=0, batch_size=config.sft.batch_size, seq_len=cfg32.max_seq_len,
                              error_rate=config.sft.error_rate)
  for _ in range(args.sft_steps):
    batch = next(it)
    state, _ = step(state, jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"]))
  params = jax.device_get(state.params)
  examples = task.sample(1, args.prompts, split="eval")
  prompts = [tok.encode(e["prompt"]) for e in examples]

  def sample(cfg):
    return sampling.generate(params, cfg, prompts, max_new_tokens=config.rl.max_new_tokens, temperature=1.0,
                             stop_token_ids=tok.stop_ids, seeds=list(range(len(prompts))))

  rows32 = sample(cfg32)
  T = cfg32.max_seq_len
  tokens = np.zeros((len(prompts), T), np.int32)
  mask = np.zeros((len(prompts), T), np.float32)
  for b, (p_ids, r) in enumerate(zip(prompts, rows32)):
    ids = list(p_ids) + r.output_ids
    tokens[b, :len(ids)] = ids
    mask[b, len(p_ids):len(ids)] = 1.0

  def sampler_logp(rows):
    out = np.zeros_like(mask)
    for b, (p_ids, r) in enumerate(zip(prompts, rows)):
      out[b, len(p_ids):len(p_ids) + len(r.logprobs)] = r.logprobs
    return out

  # The bf16 sampler scored on the f32 sampler's tokens: same seeds, so rows agree until the first token
  # where bf16 draws differently; compare only rows whose tokens are identical.
  rows16 = sample(cfg16)
  same = np.array([a.output_ids == b.output_ids for a, b in zip(rows32, rows16)], np.float32)
  learner32 = np.asarray(model_lib.token_logprobs(params, cfg32, tokens, mask))
  learner16 = np.asarray(model_lib.token_logprobs(params, cfg16, tokens, mask))
  learner16h = np.asarray(model_lib.token_logprobs(params, cfg16h, tokens, mask))
  rows16h = sample(cfg16h)
  same_h = np.array([a.output_ids == b.output_ids for a, b in zip(rows32, rows16h)], np.float32)
  zeros = np.zeros(len(prompts), np.float32)
  ones = np.ones(len(prompts), np.float32)

  def gap(a, b, valid=ones):
    m = diagnostics.mismatch_metrics(jnp.asarray(a), jnp.asarray(b), jnp.asarray(mask), jnp.asarray(zeros),
                                     jnp.asarray(valid))
    return {k.split("/")[-1]: float(v) for k, v in m.items() if k.startswith("mismatch/lag0/")}

  result = {
      "sft_steps": args.sft_steps, "prompts": len(prompts), "tokens": int(mask.sum()),
      "learner_bf16_vs_learner_f32": gap(learner16, learner32),
      "sampler_f32_vs_learner_f32": gap(learner32, sampler_logp(rows32)),
      "sampler_bf16_vs_learner_f32": gap(learner32, sampler_logp(rows16), same),
      "sampler_bf16_vs_learner_bf16": gap(learner16, sampler_logp(rows16), same),
      "learner_bf16_f32head_vs_learner_f32": gap(learner16h, learner32),
      "sampler_bf16_f32head_vs_learner_bf16_f32head": gap(learner16h, sampler_logp(rows16h), same_h),
      "backend": jax.default_backend(), "model": cfg32.to_dict(),
  }
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
