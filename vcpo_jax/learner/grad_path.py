"""Which per-sequence gradient path a step takes: book-keeping when its stored a/g fit a memory budget."""
from __future__ import annotations

import logging

import jax.numpy as jnp

from vcpo_jax.parallel import target

# book_keeping: one backward; every layer's dense inputs a and output-gradients g are kept until the
#   coefficients are known (learner.grad_norms): fastest, memory ~ layers x width x tokens.
# bounded: norms formed layer by layer inside the backward, then an ordinary backward through the same
#   forward (learner.bounded_norms): memory ~ an ordinary step's.
# two_pass: book-keeping's norms (kept a/g), then a second forward and backward (the reference path).
# auto: book_keeping when possible and its estimate fits the budget per device, else bounded; the budget is
#   grad_memory_budget_gb, at most TARGET_SHARE of the target device's memory (a 16 GB TPU v5e keeps the rest
#   for the state and activations; an 80 GB GPU keeps the configured 16 GB).
PATHS = ("auto", "book_keeping", "bounded", "two_pass")
# XLA temporaries of the book-keeping step over an ordinary step's, per stored byte of a/g: measured 3.1 MB
# against 2.54 MB stored per token at the Qwen2.5-0.5B shape, remat=full, B=8 x T=1024 (compile_after.md);
# rounded up so that the estimate errs towards the bounded path.
OVERHEAD = 1.25
TARGET_SHARE = 0.25


def stored_elements_per_token(model_cfg) -> int:
  """Elements of a and g book-keeping keeps per token: per layer the inputs of q, k, v, o, gate, up, down and
  of both RMSNorms (their xhat) and the output-gradients of the same ops, + the final norm's (grad_norms.capture);
  with model.lora also each adapter's rank-r activations."""
  d, f = model_cfg.hidden_size, model_cfg.intermediate_size
  q, kv = model_cfg.num_heads * model_cfg.head_dim, model_cfg.num_kv_heads * model_cfg.head_dim
  inputs = 3 * d + q + 2 * d + f + 2 * d
  out_grads = q + 2 * kv + d + 2 * f + d + 2 * d
  lora = 2 * len(model_cfg.lora.target_modules) * model_cfg.lora.rank  # each adapter's B input and A out-grad
  return model_cfg.num_layers * (inputs + out_grads + lora) + 2 * d


def bookkeeping_bytes(model_cfg, rows_per_device: int, seq_len: int) -> float:
  """Estimated extra bytes per device of the book-keeping step (stored a/g x OVERHEAD)."""
  itemsize = jnp.dtype(model_cfg.jnp_dtype).itemsize
  return OVERHEAD * itemsize * stored_elements_per_token(model_cfg) * rows_per_device * seq_len


def why_no_bookkeeping(lc) -> str | None:
  """None when the loss's gradient is a per-sequence-weighted score sum that book-keeping can form."""
  if lc.kl_beta:
    return f"kl_beta={lc.kl_beta} adds a per-token term"
  if not lc.loss_entry.fact("seq_coefficient", lc.loss_options()):
    return f"policy_loss={lc.policy_loss!r} has per-token coefficients"
  return None


def budget_gb(lc) -> tuple[float, str]:
  """(GB per device book-keeping's a/g may take, where it comes from): algo.grad_memory_budget_gb, capped at
  TARGET_SHARE of the memory of the device compiled for (vcpo_jax.parallel.target)."""
  t = target.current()
  cap = TARGET_SHARE * t.memory_bytes / 1e9 if t.memory_bytes else None
  if cap is not None and cap < lc.grad_memory_budget_gb:
    return cap, f"{TARGET_SHARE:g} of {t.memory_source} {t.memory_bytes / 1e9:.1f} GB"
  return lc.grad_memory_budget_gb, f"algo.grad_memory_budget_gb={lc.grad_memory_budget_gb}"


def choose(lc, model_cfg, rows: int, seq_len: int, row_shards: int = 1) -> tuple[str, str]:
  """(path, reason) for a step over `rows` x `seq_len` (rows of one micro-batch chunk, split over row_shards
  devices). Without per-sequence norms every path is the plain backward ('plain')."""
  if not lc.needs_grad_norms:
    return "plain", f"advantage={lc.advantage!r} needs no per-sequence gradient norms"
  if lc.grad_path != "auto":
    return lc.grad_path, f"algo.grad_path={lc.grad_path!r} set explicitly"
  why = why_no_bookkeeping(lc)
  if why:
    return "bounded", f"book-keeping impossible: {why}"
  per_device = -(-rows // max(row_shards, 1))
  need_gb = bookkeeping_bytes(model_cfg, per_device, seq_len) / 1e9
  shape = (f"{per_device} rows x {seq_len} tokens x {model_cfg.num_layers} layers per device "
           f"(micro-batch {rows} rows over {row_shards} shards)")
  budget, source = budget_gb(lc)
  if need_gb <= budget:
    return "book_keeping", f"book-keeping's a/g ~{need_gb:.2f} GB <= {budget:.2f} GB ({source}) for {shape}"
  return "bounded", f"book-keeping's a/g ~{need_gb:.2f} GB > {budget:.2f} GB ({source}) for {shape}"


def log_choice(lc, model_cfg, rows: int, seq_len: int, row_shards: int = 1) -> str:
  path, reason = choose(lc, model_cfg, rows, seq_len, row_shards)
  logging.info("per-sequence gradient path: %s (%s)", path, reason)
  return path
