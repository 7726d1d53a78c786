"""Figure 4: embedded sampler decode tokens/s vs HF transformers `generate` (same weights) and vs no KV cache."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

from benchmarks import common

TITLE = "decode tokens/s: ours / HF generate (CPU torch)"
GOAL = ">= 3"


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
  batch: int
  prompt_len: int
  new_tokens: int
  warmup: int
  repeats: int


FULL = DecodeSetup(batch=128, prompt_len=32, new_tokens=32, warmup=1, repeats=5)
QUICK = DecodeSetup(batch=8, prompt_len=16, new_tokens=16, warmup=1, repeats=2)


def main_job_model_config():
  """The model of the main job (configs/countdown.py), so the figure describes what training runs."""
  from configs import countdown
  from vcpo_jax import model as model_lib
  return model_lib.ModelConfig.from_dict(countdown.get_config().model)


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """Equal-length prompts, so neither side pays for padding the other does not."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, vocab, size=(batch, length)).tolist()


def load_hf_model(model_dir: str):
  import torch
  import transformers
  hf_model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  return hf_model.eval()


def hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int) -> np.ndarray:
  """Greedy HF generation of exactly `new_tokens` tokens per row; returns the new token ids."""
  import torch
  input_ids = torch.tensor(prompts, dtype=torch.long)
  with torch.inference_mode():
    out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
  return out[:, input_ids.shape[1]:].numpy()


def pick_torch_threads(hf_model, prompts, new_tokens: int) -> dict[int, float]:
  """Sets torch's thread count to the fastest of {1, all cores} for this call (the fair HF baseline).

  Why: on a loaded, small machine torch's multi-threaded kernels can be many times slower than one
  thread for a model this small, and the baseline should be HF at its best, not at its default.
  """
  import torch
  trial = {}
  for threads in sorted({1, os.cpu_count() or 1}):
    torch.set_num_threads(threads)
    hf_greedy(hf_model, prompts, new_tokens)
    trial[threads] = min(common.time_once(lambda: hf_greedy(hf_model, prompts, new_tokens)) for _ in range(2))
  torch.set_num_threads(min(trial, key=trial.get))
  return trial


def ours_greedy(params, cfg, prompts, new_tokens: int, use_cache: bool = True) -> np.ndarray:
  from vcpo_jax import sampling
  rows = sampling.generate(params, cfg, prompts, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                           seeds=[0] * len(prompts), use_cache=use_cache)
  return np.array([r.output_ids for r in rows])


def produce(quick: bool) -> list[dict]:
  return common.run_figure("decode", TITLE, lambda: _measure(QUICK if quick else FULL), goal=GOAL)


def _measure(setup: DecodeSetup) -> list[dict]:
  import jax
  import torch
  from vcpo_jax import hf
  from vcpo_jax import model as model_lib

  cfg = main_job_model_config()
  params = model_lib.init_params(cfg, jax.random.key(0))
  prompts = random_prompts(setup.batch, setup.prompt_len, cfg.vocab_size)
  n = setup.new_tokens
  with tempfile.TemporaryDirectory() as tmp:
    hf_model = load_hf_model(hf.export_hf(params, cfg, os.path.join(tmp, "hf")))

  ours_ids = ours_greedy(params, cfg, prompts, n)
  hf_ids = hf_greedy(hf_model, prompts, n)
  thread_trial = pick_torch_threads(hf_model, prompts, n)
  if ours_ids.shape != hf_ids.shape:
    raise RuntimeError(f"ours generated {ours_ids.shape}, HF generated {hf_ids.shape}")
  thunks = {
      "ours_kv_cache": lambda: ours_greedy(params, cfg, prompts, n),
      "hf_generate": lambda: hf_greedy(hf_model, prompts, n),
      "ours_no_cache": lambda: ours_greedy(params, cfg, prompts, n, use_cache=False),
  }
  times = common.time_calls(thunks, warmup=setup.warmup, repeats=setup.repeats)
  tokens = setup.batch * n
  details = {
      "batch": setup.batch, "prompt_len": setup.prompt_len, "new_tokens": n, "tokens_per_call": tokens,
      "model": cfg.to_dict(), "num_params": model_lib.count_params(params),
      "torch_threads": torch.get_num_threads(), "torch_thread_trial_seconds": thread_trial,
      "tokens_per_s": {k: tokens / common.summarize(v).median for k, v in times.items()},
      "seconds": common.timing_details(times),
      # Random-init logits are nearly flat, so greedy paths may part on float ties; row 0 / token 0 agree.
      "greedy_token_agreement": float(np.mean(ours_ids == hf_ids)),
      "first_token_agreement": float(np.mean(ours_ids[:, 0] == hf_ids[:, 0])),
      "timed": "whole generate call: prefill + decode + host read-back, greedy, fixed length",
  }
  vs_hf = common.summarize(common.ratio_samples(times["hf_generate"], times["ours_kv_cache"]))
  vs_nc = common.summarize(common.ratio_samples(times["ours_no_cache"], times["ours_kv_cache"]))
  shape = f"B={setup.batch}, prompt {setup.prompt_len}, new {n}"
  return [
      common.figure("decode_vs_hf", TITLE, unit="x", goal=GOAL, stats=vs_hf, details=details,
                    note=f"{shape}; ours {details['tokens_per_s']['ours_kv_cache']:.0f} tok/s, "
                         f"HF {details['tokens_per_s']['hf_generate']:.0f} tok/s"),
      common.figure("decode_vs_no_cache", "decode tokens/s: ours KV cache / ours no cache", unit="x",
                    stats=vs_nc, note=f"{shape}; no-cache {details['tokens_per_s']['ours_no_cache']:.0f} tok/s"),
  ]


if __name__ == "__main__":
  common.module_main(produce, __doc__)
