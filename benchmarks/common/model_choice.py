"""Which model the figures use: --model / $BENCH_MODEL resolved to a job config and its model config."""
from __future__ import annotations

import os

# "main" (alias "countdown") is the main CPU job's model (configs/countdown.py); "tiny" is configs/tiny.py's
# (seconds per figure: smoke runs); "qwen2.5-0.5b" is the Qwen2.5-0.5B shape (configs/qwen2_5.py:0.5b, random
# weights, bfloat16 compute as real-model runs use); "auto" picks main on CPU and the 0.5B shape on an
# accelerator. Children read it from BENCH_MODEL.
MODELS = ("auto", "main", "countdown", "tiny", "qwen2.5-0.5b")
ALIASES = {"countdown": "main"}
SMALL_MODELS = ("main", "tiny")   # CPU-sized: their figures use the CPU job's batch sizes
MODEL_ENV = "BENCH_MODEL"


def resolve_model(choice: str | None = None, backend: str | None = None) -> str:
  """'main', 'tiny' or 'qwen2.5-0.5b' for a --model choice (default: $BENCH_MODEL, else auto) on `backend`."""
  choice = choice or os.environ.get(MODEL_ENV) or "auto"
  if choice not in MODELS:
    raise ValueError(f"--model must be one of {MODELS}, got {choice!r}")
  if choice != "auto":
    return ALIASES.get(choice, choice)
  if backend is None:
    import jax
    backend = jax.default_backend()
  return "main" if backend == "cpu" else "qwen2.5-0.5b"


def small_model(name: str | None = None) -> bool:
  """Whether the figures' model is CPU-sized (main or tiny), i.e. uses the CPU job's sizes."""
  return resolve_model(name) in SMALL_MODELS


def job_config(name: str | None = None):
  """The training job config whose model and learner the figures use (see MODELS)."""
  name = resolve_model(name)
  if name == "main":
    from configs import countdown
    return countdown.get_config()
  if name == "tiny":
    from configs import tiny
    return tiny.get_config()
  from configs import qwen2_5
  config = qwen2_5.get_config("0.5b")
  config.model.update(dtype="bfloat16", matmul_precision="default")
  return config


def model_config(name: str | None = None):
  from vcpo_jax.model import hf
  return hf.model_config(job_config(name).model)
