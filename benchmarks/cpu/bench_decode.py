"""Figure 4: embedded sampler decode tokens/s vs HF transformers `generate` (same weights) and vs no KV cache;
the server's continuous batching vs the previous windowed batches; decode step time vs the memory floor."""
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


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """Equal-length prompts, so neither side pays for padding the other does not."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, vocab, size=(batch, length)).tolist()


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


def sampling_bucket(prompt_len: int) -> int:
  from vcpo_jax.model import sampling
  return sampling.bucket(prompt_len, 16)


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
  bandwidth = measure_bandwidth()
  for batch in setup.batches:
    figures += records.run_figure(f"decode_continuous_vs_windowed_b{batch}", f"{POOL_TITLE}, B={batch}",
                                  lambda: continuous_vs_windowed(setup, batch, params, cfg))
    figures += records.run_figure(f"decode_floor_fraction_b{batch}", f"{FLOOR_TITLE}, B={batch}",
                                  lambda: floor_fraction(setup, batch, params, cfg, bandwidth),
                                  goal=floor_goal(batch))
  return figures


POOL_TITLE = "decode tokens/s: continuous batching / windowed batches"
FLOOR_TITLE = "decode step: memory floor / measured step time"


def floor_goal(batch: int) -> str | None:
  """The goal (>= 50% of the floor, benchmarks/common/goals.py) is set for the 0.5B shape at B=256 on an accelerator."""
  return ">= 0.5" if batch == 256 and not model_choice.small_model() else None


def mixed_rows(batch: int, setup: DecodeSetup, vocab: int) -> list:
  """2 x batch greedy rows whose lengths spread over [new/4, new], as RL samples ending on EOS do."""
  from vcpo_jax.model import sampling
  rng = np.random.default_rng(batch)
  news = rng.integers(max(1, setup.new_tokens // 4), setup.new_tokens + 1, size=2 * batch)
  prompts = random_prompts(2 * batch, setup.prompt_len, vocab, seed=batch)
  return [sampling.RowSpec(prompt=tuple(p), max_new_tokens=int(n), temperature=0.0, ignore_eos=True)
          for p, n in zip(prompts, news)]


def windowed(params, cfg, specs, batch: int, chunk: int) -> int:
  """The previous engine: windows of `batch` rows, each decoded (host read-back per chunk) until its
  longest row finishes; returns the tokens generated."""
  from vcpo_jax.model import sampling
  total = 0
  for i in range(0, len(specs), batch):
    b = sampling.start_batch(params, cfg, specs[i:i + batch], min_batch=batch)
    done = sampling.progress(b)[3]
    while not done.all():
      sampling.decode_chunk(params, b, chunk)
      done = sampling.progress(b)[3]
    total += int(sampling.progress(b)[2].sum())
  return total


def pool_slots(setup: DecodeSetup) -> int:
  """Cache slots per row: the windowed batch's prompt + new-token buckets (same attention length)."""
  from vcpo_jax.model import sampling
  return sampling_bucket(setup.prompt_len) + sampling.bucket(setup.new_tokens, 16)


def continuous(params, cfg, specs, batch: int, chunk: int, num_slots: int) -> int:
  """The embedded server's engine without HTTP: rows join a `batch`-slot pool as others finish."""
  from vcpo_jax.serving import slot_pool
  rows = slot_pool.generate(params, cfg, specs, max_rows=batch, num_slots=num_slots, chunk_steps=chunk)
  return sum(len(r.output_ids) for r in rows)


def continuous_vs_windowed(setup: DecodeSetup, batch: int, params, cfg) -> list[dict]:
  specs = mixed_rows(batch, setup, cfg.vocab_size)
  C, S = setup.chunk_steps, pool_slots(setup)
  tokens = sum(r.max_new_tokens for r in specs)
  counts = {"continuous": continuous(params, cfg, specs, batch, C, S), "windowed": windowed(params, cfg, specs,
                                                                                             batch, C)}
  if set(counts.values()) != {tokens}:
    raise RuntimeError(f"generated {counts}, expected {tokens} tokens")
  times = timing.time_calls({"continuous": lambda: continuous(params, cfg, specs, batch, C, S),
                             "windowed": lambda: windowed(params, cfg, specs, batch, C)},
                            warmup=setup.warmup, repeats=setup.repeats)
  tok_s = {k: tokens / summary.summarize(v).median for k, v in times.items()}
  stats = summary.summarize(summary.ratio_samples(times["windowed"], times["continuous"]))
  return [records.figure(
      f"decode_continuous_vs_windowed_b{batch}", f"{POOL_TITLE}, B={batch}", unit="x", stats=stats,
      details={"rows": len(specs), "max_batch": batch, "chunk_steps": C, "cache_slots": S,
               "prompt_len": setup.prompt_len, "new_tokens_range": [min(r.max_new_tokens for r in specs),
                                                                    setup.new_tokens],
               "tokens_per_call": tokens, "tokens_per_s": tok_s, "seconds": timing.timing_details(times),
               "timed": "prefill + decode + host read-back per chunk, greedy; windowed = the previous engine"},
      note=f"{len(specs)} rows, new tokens {min(r.max_new_tokens for r in specs)}-{setup.new_tokens}, "
           f"B={batch}; continuous {tok_s['continuous']:.0f} tok/s, windowed {tok_s['windowed']:.0f} tok/s")]


def measure_bandwidth(num_bytes: int = 2**28, repeats: int = 5) -> float:
  """Device memory bandwidth (bytes/s) of a large elementwise op: reads and writes num_bytes each."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  double = jax.jit(lambda a: a * 2.0)
  timing.block(double(x))
  best = min(timing.time_once(lambda: double(x)) for _ in range(repeats))
  return 2.0 * num_bytes / best


def floor_bytes(params, cfg, pool, live_tokens: int) -> tuple[float, float]:
  """(bytes one decode step must read: params + the live KV entries, bytes of the whole allocated cache).

  The embedding table is not read whole (B rows are looked up) unless it is the tied LM head."""
  import jax
  embed = params["embed_tokens"].nbytes
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - (0 if cfg.tie_word_embeddings else embed)
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(pool.state.cache))
  per_token = cache_bytes / (len(pool.owners) * pool.S)
  return param_bytes + per_token * live_tokens, param_bytes + cache_bytes


def floor_fraction(setup: DecodeSetup, batch: int, params, cfg, bandwidth: float) -> list[dict]:
  """Steady-state decode step of a full pool (every row live) against params + live KV read once per step."""
  from vcpo_jax.model import sampling
  from vcpo_jax.serving import slot_pool
  C = setup.chunk_steps
  chunks = max(2, setup.new_tokens // C - 2)
  S = setup.prompt_len + (chunks + 2) * C + 1
  pool = slot_pool.SlotPool(cfg, max_rows=batch, num_slots=S, chunk_steps=C, min_rows=batch)
  specs = [sampling.RowSpec(prompt=tuple(p), max_new_tokens=S - setup.prompt_len, temperature=0.0,
                            ignore_eos=True) for p in random_prompts(batch, setup.prompt_len, cfg.vocab_size)]
  pool.join(params, specs, list(range(batch)))
  pool.step(params)  # compile
  seconds = [timing.time_once(lambda: pool.step(params), sync=lambda x: x) for _ in range(chunks)]
  step_s = summary.summarize(seconds).median / C
  mean_context = setup.prompt_len + 1 + C * (1 + chunks / 2)
  need, allocated = floor_bytes(params, cfg, pool, int(batch * mean_context))
  fraction = need / bandwidth / step_s
  return [records.figure(
      f"decode_floor_fraction_b{batch}", f"{FLOOR_TITLE}, B={batch}", unit="x", value=fraction,
      goal=floor_goal(batch), stats=None,
      details={"step_seconds": step_s, "tokens_per_s": batch / step_s, "bytes_per_step": need,
               "bytes_per_step_whole_cache": allocated, "bandwidth_bytes_per_s": bandwidth,
               "bandwidth_measured_by": "jit(a * 2) over 256 MiB float32 on the default device, best of 5",
               "mean_context": mean_context, "cache_slots": S, "cache_dtype": str(pool.cache_dtype),
               "fraction_if_whole_cache_read": allocated / bandwidth / step_s, "chunk_steps": C},
      note=f"B={batch}, context ~{mean_context:.0f}; {batch / step_s:.0f} tok/s; floor "
           f"{need / bandwidth * 1e3:.3f} ms/step at a measured {bandwidth / 1e9:.1f} GB/s, "
           f"measured {step_s * 1e3:.3f} ms/step")]


def _measure_batch(setup: DecodeSetup, batch: int, headline: bool, params, cfg, hf_model) -> list[dict]:
  from vcpo_jax.model import transformer as model_lib
  prompts = random_prompts(batch, setup.prompt_len, cfg.vocab_size, seed=batch)
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
  flops = {"ours_kv_cache": forward_flops(cfg, params, batch, sampling_bucket(setup.prompt_len) + n),
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
