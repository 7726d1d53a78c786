"""LearnerConfig: what the RL step computes, checked against the registered facts; micro-batch chunk layout."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from vcpo_jax.algo import losses
from vcpo_jax.learner import grad_norms
from vcpo_jax.learner import grad_path as grad_path_lib

GRAD_PATHS = grad_path_lib.PATHS


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Names refer to the registries in advantages.py / policy_losses.py (plain values, no ml_collections).

  Option fields take a mapping (or the registered options dataclass) of the chosen estimator's / loss's
  options; they are kept as sorted (key, value) tuples so the config is hashable (a cache key).
  """
  advantage: str = "opob"
  advantage_options: Any = ()
  policy_loss: str = "vcpo"
  policy_loss_options: Any = ()
  aggregation: str = "seq-mean-token-mean"
  tis_threshold: Optional[float] = 8.0     # tau of the truncated sequence weights (OPOB, metrics, 'uses_tau' losses)
  kl_beta: float = 0.0                     # > 0: + beta * k3 to the frozen reference (TrainState.ref_params)
  grad_path: str = "auto"                  # learner.grad_path.PATHS: auto | book_keeping | bounded | two_pass
  grad_memory_budget_gb: float = 16.0      # auto: book-keeping while its a/g (per device) fit in this, else bounded
  grad_norm_mode: str = "auto"             # grad_norms mode: 'auto' | 'ghost' | 'explicit'
  micro_batch_size: int = 0                # > 0: rows processed in chunks of whole groups (scan); 0: at once
  # rl.max_new_tokens: the constant that 'seq-mean-token-sum-norm' (Dr.GRPO) divides each token sum by; a
  # batch statistic (the longest response) would make the per-token weight depend on the other rows.
  generation_budget: Optional[int] = None
  # True: the step also computes the group-mean estimator's gradient and update (update_diagnostics.py).
  update_diagnostics: bool = False

  def __post_init__(self):
    for name in ("advantage_options", "policy_loss_options"):
      object.__setattr__(self, name, _frozen_items(getattr(self, name), name))
    self.estimator_options()   # unknown names and options raise here, naming them
    self.loss_options()
    if self.aggregation not in losses.AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {losses.AGGREGATIONS}, got aggregation={self.aggregation!r}")
    if self.aggregation == "seq-mean-token-sum-norm" and (
        isinstance(self.generation_budget, bool) or not isinstance(self.generation_budget, int)
        or self.generation_budget < 1):
      raise ValueError(f"aggregation={self.aggregation!r} divides by the generation budget (rl.max_new_tokens): "
                       f"generation_budget must be an int >= 1, got generation_budget={self.generation_budget!r}")
    if self.tis_threshold is not None and not self.tis_threshold > 0:
      raise ValueError(f"tis_threshold must be positive or None, got tis_threshold={self.tis_threshold!r}")
    if not self.kl_beta >= 0:
      raise ValueError(f"kl_beta must be >= 0, got kl_beta={self.kl_beta!r}")
    if self.grad_path not in GRAD_PATHS:
      raise ValueError(f"grad_path must be one of {GRAD_PATHS}, got grad_path={self.grad_path!r}")
    if isinstance(self.grad_memory_budget_gb, bool) or not self.grad_memory_budget_gb >= 0:
      raise ValueError(f"grad_memory_budget_gb must be a number >= 0, got {self.grad_memory_budget_gb!r}")
    why_not = grad_path_lib.why_no_bookkeeping(self) if self.grad_path == "book_keeping" else None
    if why_not and self.needs_grad_norms:
      raise ValueError(f"grad_path='book_keeping' is impossible here: {why_not}; use 'bounded' or 'auto'")
    if not isinstance(self.update_diagnostics, bool):
      raise ValueError(f"update_diagnostics must be True or False, got {self.update_diagnostics!r}")
    if self.grad_norm_mode not in grad_norms.MODES:
      raise ValueError(f"grad_norm_mode must be one of {grad_norms.MODES}, got {self.grad_norm_mode!r}")
    if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
        or self.micro_batch_size < 0:
      raise ValueError(f"micro_batch_size must be an int >= 0, got micro_batch_size={self.micro_batch_size!r}")
    if self.micro_batch_size and not self.chunkable:
      raise ValueError(
          f"micro_batch_size={self.micro_batch_size} needs statistics local to prompt groups, but "
          f"{self.why_not_chunkable()}; set micro_batch_size=0")

  # Registered entries and typed options ------------------------------------------------------------
  @property
  def advantage_entry(self):
    return losses.ADVANTAGE_ESTIMATORS.get(self.advantage)

  @property
  def loss_entry(self):
    return losses.POLICY_LOSSES.get(self.policy_loss)

  def estimator_options(self):
    return self.advantage_entry.make_options(dict(self.advantage_options))

  def loss_options(self):
    entry = self.loss_entry
    tau = {"tau": self.tis_threshold} if entry.fact("uses_tau") else {}
    return entry.make_options(dict(self.policy_loss_options), **tau)

  # Facts -----------------------------------------------------------------------------------------------
  def why_not_chunkable(self) -> Optional[str]:
    """None when each row's advantage and loss depend only on its own group (chunks of groups are exact)."""
    if self.advantage_entry.fact("batch_global", self.estimator_options()):
      return (f"advantage={self.advantage!r} with options {dict(self.advantage_options)} uses a "
              f"batch-global statistic")
    if self.loss_entry.fact("batch_global", self.loss_options()):
      return f"policy_loss={self.policy_loss!r} uses a batch-global statistic"
    return None

  @property
  def chunkable(self) -> bool:
    return self.why_not_chunkable() is None

  @property
  def group_local(self) -> bool:
    """The estimator's statistic is per prompt group (it needs >= 2 samples per group)."""
    return self.advantage_entry.fact("group_local", self.estimator_options())

  @property
  def needs_grad_norms(self) -> bool:
    return self.advantage_entry.fact("needs_grad_norms", self.estimator_options())

  @property
  def uses_bookkeeping(self) -> bool:
    """Book-keeping is possible and grad_path allows it ('auto' also asks the memory budget: learner.grad_path)."""
    return (self.needs_grad_norms and self.grad_path in ("auto", "book_keeping")
            and grad_path_lib.why_no_bookkeeping(self) is None)


def _frozen_items(options, field: str) -> tuple:
  if dataclasses.is_dataclass(options) and not isinstance(options, type):
    options = dataclasses.asdict(options)
  if isinstance(options, tuple):
    options = dict(options)
  if options is None:
    options = {}
  if not hasattr(options, "items"):
    raise ValueError(f"LearnerConfig.{field} must be a mapping of options, got {field}={options!r}")
  return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in dict(options).items()))


def auto_micro_batch_size(lc: LearnerConfig, batch_rows: int, group_size: int, max_rows: int) -> int:
  """Largest multiple of group_size dividing batch_rows and <= max_rows (one group if a group is larger);
  0 when the registered facts forbid chunking or one chunk would hold the whole batch."""
  if not lc.chunkable or group_size < 1 or batch_rows % group_size:
    return 0
  sizes = [m for m in range(group_size, batch_rows + 1, group_size) if batch_rows % m == 0 and m <= max_rows]
  micro = max(sizes) if sizes else group_size
  return 0 if micro >= batch_rows else micro


# ------------------------------------------------------------------------------------- chunk layout
def chunk_order(b: int, micro: int, row_shards: int):
  """Row permutation into [chunks, micro]: each chunk takes micro/row_shards contiguous rows of every
  data shard, so every device works on every chunk (and contiguous groups stay whole)."""
  idx = np.arange(b).reshape(row_shards, b // micro, micro // row_shards)
  return idx.transpose(1, 0, 2).reshape(b // micro, micro)


def check_chunks(batch, micro_batch_size: int, row_shards: int = 1):
  """Host-side: micro-batch chunks (see chunk_order) must hold whole prompt groups."""
  b = batch.tokens_BxT.shape[0]
  if not micro_batch_size or micro_batch_size >= b:
    return
  if b % micro_batch_size or micro_batch_size % row_shards:
    raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch rows B={b} and be a multiple "
                     f"of the data shards ({row_shards})")
  if not getattr(batch.group_B, "is_fully_addressable", True):
    return  # rows on several processes: the leader checked its host batch (train.RLRun.learn)
  chunk_of_row = np.empty(b, np.int64)
  chunk_of_row[chunk_order(b, micro_batch_size, row_shards).reshape(-1)] = np.repeat(
      np.arange(b // micro_batch_size), micro_batch_size)
  groups = np.asarray(batch.group_B)
  for g in np.unique(groups):
    if len(np.unique(chunk_of_row[groups == g])) > 1:
      raise ValueError(f"micro_batch_size={micro_batch_size} splits prompt group {g} across chunks; groups must "
                       f"be contiguous rows and the group size must divide micro_batch_size / data shards")
