"""GPU check, decode: the embedded server's engine (bf16, greedy) against HF `generate` on the same weights
and against the memory floor at a device bandwidth measured in the same run, at B=64 and B=256.

  python -m benchmarks.gpu.bench_gpu_decode --json /tmp/decode.json --model qwen2.5-0.5b
  python -m benchmarks.gpu.bench_gpu_decode --quick --model tiny        # seconds, on a CPU
"""
from __future__ import annotations

import os
import tempfile

from benchmarks.cpu import bench_decode, decode_engine
from benchmarks.common import records
from benchmarks.common import summary
from benchmarks.common import timing

TITLE = "decode tokens/s: embedded engine / HF generate (same weights, bf16, greedy)"
FULL = bench_decode.DecodeSetup(batches=(64, 256), prompt_len=128, new_tokens=256, warmup=1, repeats=2,
                                no_cache_repeats=0)
QUICK = bench_decode.DecodeSetup(batches=(2, 4), prompt_len=16, new_tokens=8, warmup=1, repeats=2,
                                 no_cache_repeats=0)
HF_WARMUP_TOKENS = 8       # HF's warm-up call (CUDA and cuBLAS start-up) need not be long


def equal_rows(batch: int, setup: bench_decode.DecodeSetup, vocab: int) -> list:
  """`batch` greedy rows of the same prompt length and exactly new_tokens new tokens (no EOS stop)."""
  from vcpo_jax.model import sampling
  return [sampling.RowSpec(prompt=tuple(p), max_new_tokens=setup.new_tokens, temperature=0.0, ignore_eos=True)
          for p in decode_engine.random_prompts(batch, setup.prompt_len, vocab, seed=batch)]


def engine_vs_hf(setup: bench_decode.DecodeSetup, batch: int, params, cfg, hf_model) -> list[dict]:
  """Whole calls, prefill + decode + host read-back: the engine's slot pool (one row per slot) vs HF."""
  specs = equal_rows(batch, setup, cfg.vocab_size)
  prompts = [list(s.prompt) for s in specs]
  slots, n, C = decode_engine.pool_slots(setup), setup.new_tokens, setup.chunk_steps
  engine = lambda: decode_engine.continuous(params, cfg, specs, batch, C, slots)
  # One torch thread on a CPU: on a small, loaded CPU more threads can be many times slower (bench_decode).
  hf = lambda: bench_decode.hf_greedy_threads(hf_model, prompts, n, 1) if bench_decode.torch_device() == "cpu" \
      else bench_decode.hf_greedy(hf_model, prompts, n)
  if engine() != batch * n:
    raise RuntimeError(f"the engine generated {engine()} tokens, expected {batch * n}")
  bench_decode.hf_greedy(hf_model, prompts, HF_WARMUP_TOKENS)
  times = timing.time_calls({"engine": engine, "hf_generate": hf}, warmup=0, repeats=setup.repeats)
  tok_s = {k: batch * n / summary.summarize(v).median for k, v in times.items()}
  return [records.figure(
      f"decode_engine_vs_hf_b{batch}", f"{TITLE}, B={batch}", unit="x",
      stats=summary.summarize(summary.ratio_samples(times["hf_generate"], times["engine"])),
      details={"tokens_per_s": tok_s, "seconds": timing.timing_details(times), "cache_slots": slots,
               "chunk_steps": C, "hf_device": bench_decode.torch_device(), "prompt_len": setup.prompt_len,
               "new_tokens": n},
      note=f"B={batch}, prompt {setup.prompt_len}, new {n}; engine {tok_s['engine']:.0f} tok/s, "
           f"HF {tok_s['hf_generate']:.0f} tok/s on {bench_decode.torch_device()}")]


def produce(quick: bool, figs: list[dict], json_path: str | None) -> list[dict]:
  """Appends the figures to `figs`, written to json_path after each one (a part stopped at its limit keeps
  what it measured)."""
  import jax
  from vcpo_jax.model import hf_export
  from vcpo_jax.model import transformer as model_lib
  setup = QUICK if quick else FULL
  cfg = bench_decode.main_job_model_config()
  params = model_lib.init_params(cfg, jax.random.key(0))

  def add(new):
    figs.extend(new)
    if json_path:
      records.emit_figures(figs, json_path)
  bandwidth = None
  try:
    bandwidth = decode_engine.measure_bandwidth(num_bytes=2**24 if quick else 2**30)
    add([records.figure("hbm_bandwidth", "device memory bandwidth (jit(a * 2): bytes read + written, best of 5)",
                        unit="GB/s", value=bandwidth / 1e9)])
  except Exception as e:  # noqa: BLE001
    add([records.failed_figure("hbm_bandwidth", "device memory bandwidth", f"{type(e).__name__}: {e}")])
  for batch in setup.batches:
    if bandwidth is not None:
      add(records.run_figure(f"decode_floor_fraction_b{batch}", f"{decode_engine.FLOOR_TITLE}, B={batch}",
                             lambda: decode_engine.floor_fraction(setup, batch, params, cfg, bandwidth),
                             goal=decode_engine.floor_goal(batch)))
  with tempfile.TemporaryDirectory() as tmp:
    hf_model = bench_decode.load_hf_model(hf_export.export_hf(params, cfg, os.path.join(tmp, "hf")), cfg.param_dtype)
  for batch in setup.batches:
    add(records.run_figure(f"decode_engine_vs_hf_b{batch}", f"{TITLE}, B={batch}",
                           lambda: engine_vs_hf(setup, batch, params, cfg, hf_model)))
  return figs


def main(argv=None):
  return records.incremental_main(produce, "decode", TITLE, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
  main()
