"""Figure 4: embedded sampler decode tokens/s vs HF `generate` (same weights), vs no KV cache, and decode_engine's."""
from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import numpy as np

from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.common import summary
from benchmarks.common import timing
from benchmarks.cpu import decode_engine

TITLE = "decode tokens/s: ours / HF generate"
GOAL = ">= 3"


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
  batches: tuple[int, ...]    # the first is the headline: the embedded server's default max batch
  prompt_len: int             # the main job's Countdown prompts are 57-59 tokens
  new_tokens: int             # the main job's rl.max_new_tokens
  warmup: int
  repeats: int
  no_cache_repeats: int       # the no-cache baseline is ~20x slower: fewer rounds, headline batch only
  chunk_steps: int = 8        # the embedded server's default --chunk-steps


def _main_job_new_tokens() -> int:
  from configs import countdown
  return int(countdown.get_config().rl.max_new_tokens)


FULL = DecodeSetup(batches=(64, 16), prompt_len=58, new_tokens=_main_job_new_tokens(), warmup=1, repeats=5,
                   no_cache_repeats=2)
QUICK = DecodeSetup(batches=(8,), prompt_len=16, new_tokens=16, warmup=1, repeats=2, no_cache_repeats=1)
# The Qwen2.5-0.5B shape (an accelerator's figure): bf16 weights, longer prompts and generations.
QWEN = DecodeSetup(batches=(64, 256), prompt_len=128, new_tokens=256, warmup=1, repeats=3, no_cache_repeats=1)
QWEN_QUICK = DecodeSetup(batches=(8,), prompt_len=32, new_tokens=32, warmup=1, repeats=2, no_cache_repeats=1)


def main_job_model_config():
  """The model of the measured job (configs/countdown.py, or the 0.5B shape with bf16 weights: --model)."""
  import dataclasses
  cfg = model_choice.model_config()
  return cfg if model_choice.resolve_model() == "main" else dataclasses.replace(cfg, param_dtype="bfloat16")


def setup_for(quick: bool) -> DecodeSetup:
  if model_choice.resolve_model() == "main":
    return QUICK if quick else FULL
  return QWEN_QUICK if quick else QWEN


def torch_device() -> str:
  """HF runs where torch can run fastest: a CUDA device when this torch build has one, else the CPU."""
  import torch
  return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf_model(model_dir: str, dtype: str = "float32"):
  import torch
  import transformers
  hf_model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
  return hf_model.to(torch_device()).eval()


def hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int) -> np.ndarray:
  """Greedy HF generation of exactly `new_tokens` tokens per row; returns the new token ids."""
  import torch
  input_ids = torch.tensor(prompts, dtype=torch.long, device=hf_model.device)
  with torch.inference_mode():
    out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
  return out[:, input_ids.shape[1]:].cpu().numpy()


def hf_thread_counts() -> list[int]:
  return sorted({1, os.cpu_count() or 1})


def hf_greedy_threads(hf_model, prompts, new_tokens: int, threads: int) -> np.ndarray:
  import torch
  torch.set_num_threads(threads)
  return hf_greedy(hf_model, prompts, new_tokens)


def best_of_rounds(*samples: list[float]) -> list[float]:
  """Per-round minimum over several variants of the baseline (HF at its best in every round)."""
  return [min(values) for values in zip(*samples)]


def forward_flops(cfg, params, batch: int, positions: int) -> float:
  """~2 * matmul params per processed token (prefill + decode); attention and the embedding lookup left out."""
  from benchmarks.cpu import bench_flops
  return 2.0 * bench_flops.matmul_params(cfg, params) * batch * positions


def ours_greedy(params, cfg, prompts, new_tokens: int, use_cache: bool = True) -> np.ndarray:
  from vcpo_jax.model import sampling
  rows = sampling.generate(params, cfg, prompts, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                           seeds=[0] * len(prompts), use_cache=use_cache)
  return np.array([r.output_ids for r in rows])


def produce(quick: bool) -> list[dict]:
  return records.run_figure("decode", TITLE, lambda: _measure(setup_for(quick)), goal=GOAL)


def _measure(setup: DecodeSetup) -> list[dict]:
  import jax
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import transformer as model_lib

  cfg = main_job_model_config()
  params = model_lib.init_params(cfg, jax.random.key(0))
  with tempfile.TemporaryDirectory() as tmp:
    hf_model = load_hf_model(hf_export.export_hf(params, cfg, os.path.join(tmp, "hf")), cfg.param_dtype)
  figures = []
  for i, batch in enumerate(setup.batches):
    figures += records.run_figure(f"decode_vs_hf_b{batch}", f"{TITLE}, B={batch}",
                                  lambda: _measure_batch(setup, batch, i == 0, params, cfg, hf_model), goal=GOAL)
  bandwidth = decode_engine.measure_bandwidth()
  for batch in setup.batches:
    figures += records.run_figure(f"decode_continuous_vs_windowed_b{batch}", f"{decode_engine.POOL_TITLE}, B={batch}",
                                  lambda: decode_engine.continuous_vs_windowed(setup, batch, params, cfg))
    figures += records.run_figure(f"decode_floor_fraction_b{batch}", f"{decode_engine.FLOOR_TITLE}, B={batch}",
                                  lambda: decode_engine.floor_fraction(setup, batch, params, cfg, bandwidth),
                                  goal=decode_engine.floor_goal(batch))
  return figures


def _measure_batch(setup: DecodeSetup, batch: int, headline: bool, params, cfg, hf_model) -> list[dict]:
  from vcpo_jax.model import transformer as model_lib
  prompts = decode_engine.random_prompts(batch, setup.prompt_len, cfg.vocab_size, seed=batch)
  n = setup.new_tokens
  ours_ids = ours_greedy(params, cfg, prompts, n)
  hf_ids = hf_greedy(hf_model, prompts, n)
  if ours_ids.shape != hf_ids.shape:
    raise RuntimeError(f"ours generated {ours_ids.shape}, HF generated {hf_ids.shape}")
  # Why several thread counts: on a small, loaded CPU torch's multi-threaded kernels can be many times
  # slower than one thread for a model this small; the baseline is HF at its best in each round.
  hf_names = [f"hf_generate_t{t}" for t in hf_thread_counts()]
  thunks = {"ours_kv_cache": lambda: ours_greedy(params, cfg, prompts, n)}
  for t, name in zip(hf_thread_counts(), hf_names):
    thunks[name] = functools.partial(hf_greedy_threads, hf_model, prompts, n, t)
  times = timing.time_calls(thunks, warmup=setup.warmup, repeats=setup.repeats)
  times["hf_generate"] = best_of_rounds(*(times[name] for name in hf_names))
  tokens = batch * n
  shape = f"B={batch}, prompt {setup.prompt_len}, new {n}"
  tok_s = {k: tokens / summary.summarize(v).median for k, v in times.items()}
  # Why: with ~58-token prompts and a few dozen new tokens, prefill is most of the work and both sides may be
  # compute-bound; achieved matmul GFLOP/s shows how close each is to the machine's rate.
  flops = {"ours_kv_cache": forward_flops(cfg, params, batch, decode_engine.sampling_bucket(setup.prompt_len) + n),
           "hf_generate": forward_flops(cfg, params, batch, setup.prompt_len + n)}
  gflop_s = {k: flops[k] / summary.summarize(times[k]).median / 1e9 for k in flops}
  details = {
      "batch": batch, "prompt_len": setup.prompt_len, "new_tokens": n, "tokens_per_call": tokens,
      "model": cfg.to_dict(), "num_params": model_lib.count_params(params),
      "hf_baseline": f"per round, the faster of torch thread counts {hf_thread_counts()}",
      "hf_device": torch_device(), "model_name": model_choice.resolve_model(),
      "tokens_per_s": tok_s, "seconds": timing.timing_details(times),
      "approx_matmul_gflop_per_s": gflop_s, "approx_flops_per_call": flops,
      # Random-init logits are nearly flat, so greedy paths may part on float near-ties.
      "greedy_token_agreement": float(np.mean(ours_ids == hf_ids)),
      "first_token_agreement": float(np.mean(ours_ids[:, 0] == hf_ids[:, 0])),
      "timed": "whole generate call: prefill + decode + host read-back, greedy, fixed length; "
               "ours pads prompts to a power-of-two bucket, HF runs them unpadded",
  }
  vs_hf = summary.summarize(summary.ratio_samples(times["hf_generate"], times["ours_kv_cache"]))
  figures = [records.figure(f"decode_vs_hf_b{batch}", f"{TITLE}, B={batch}", unit="x", goal=GOAL, stats=vs_hf,
                            details=details,
                            note=f"{shape}; ours {tok_s['ours_kv_cache']:.0f} tok/s, HF {tok_s['hf_generate']:.0f} "
                                 f"tok/s (best of torch threads {hf_thread_counts()})")]
  if headline:
    nc = timing.time_calls({"ours_kv_cache": thunks["ours_kv_cache"],
                            "ours_no_cache": lambda: ours_greedy(params, cfg, prompts, n, use_cache=False)},
                           warmup=1, repeats=setup.no_cache_repeats)
    vs_nc = summary.summarize(summary.ratio_samples(nc["ours_no_cache"], nc["ours_kv_cache"]))
    figures.append(records.figure(
        f"decode_vs_no_cache_b{batch}", f"decode tokens/s: ours KV cache / ours no cache, B={batch}", unit="x",
        stats=vs_nc, details={"seconds": timing.timing_details(nc)},
        note=f"{shape}; no-cache {tokens / summary.summarize(nc['ours_no_cache']).median:.0f} tok/s"))
  return figures


if __name__ == "__main__":
  records.module_main(produce, __doc__)
