"""The server's decode engine measured: continuous batching vs windowed batches, a decode step vs the memory floor."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.common import summary
from benchmarks.common import timing

if TYPE_CHECKING:
  from benchmarks.cpu.bench_decode import DecodeSetup

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


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """Equal-length prompts, so neither side pays for padding the other does not."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, vocab, size=(batch, length)).tolist()


def sampling_bucket(prompt_len: int) -> int:
  from vcpo_jax.model import sampling
  return sampling.bucket(prompt_len, 16)
