"""Grain pipelines of task prompts and SFT batches: seeded, sharded by process, checkpointable iterators."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import grain
import jax
import numpy as np

from vcpo_jax.model.tokenizer import Tokenizer
from vcpo_jax.rollout import multiturn
from vcpo_jax.tasks import base as tasks_base

DEFAULT_NUM_EXAMPLES = 1 << 24
# Distinct seed streams so prompt problems, SFT problems and SFT completions never share draws.
_STREAM_TRAIN, _STREAM_SFT, _STREAM_SFT_COMPLETION = 1, 2, 3


def _shard_args(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
  index = jax.process_index() if shard_index is None else int(shard_index)
  count = jax.process_count() if shard_count is None else int(shard_count)
  if count < 1:
    raise ValueError(f"shard_count must be >= 1, got {count}")
  if not 0 <= index < count:
    raise ValueError(f"shard_index must be in [0, {count}), got {index}")
  return index, count


def _check_seed(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2 ** 32:
    raise ValueError(f"{name} must be an int in [0, 2**32), got {value!r}")


def _check_positive(name: str, value: Any, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def _ordered(ds: grain.MapDataset, *, seed: int, shuffle: bool, shard_index: int, shard_count: int,
             num_epochs: int | None) -> grain.MapDataset:
  """Shuffle globally (reshuffled each epoch), then give every process a disjoint slice."""
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds[shard_index::shard_count]
  if len(ds) == 0:
    raise ValueError(f"shard {shard_index} of {shard_count} is empty: too few examples ({shard_count} shards)")
  return ds.repeat(num_epochs)


def _to_iter(ds: grain.MapDataset, batch_size: int | None, batch_fn, prefetch: int) -> grain.DatasetIterator:
  # One reader thread keeps element order deterministic and costs little: an example takes ~0.2 ms to build.
  read = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
  it_ds = ds.to_iter_dataset(read)
  if batch_size is not None:
    it_ds = it_ds.batch(batch_size, drop_remainder=True, batch_fn=batch_fn)
  return iter(it_ds)


class _PromptAt:
  """index -> train example; a pure function of (task knobs, problem_seed, index)."""

  def __init__(self, task: tasks_base.Task, problem_seed: int, tokenizer: Tokenizer | None):
    self.task, self.problem_seed, self.tokenizer = task, problem_seed, tokenizer

  def __call__(self, index: int) -> dict:
    example = self.task.sample([self.problem_seed, _STREAM_TRAIN, int(index)], 1, split="train")[0]
    return _with_ids({**example, "index": int(index)}, self.tokenizer)


def _with_ids(example: dict, tokenizer: Tokenizer | None) -> dict:
  if tokenizer is None:
    return example
  return {**example, "prompt_ids": tokenizer.encode(example["prompt"])}


def make_prompt_iterator(task: tasks_base.Task, *, seed: int, split: str = "train",
                         batch_size: int | None = None, shard_index: int | None = None,
                         shard_count: int | None = None, tokenizer: Tokenizer | None = None,
                         num_examples: int | None = None, num_epochs: int | None = None,
                         problem_seed: int | None = None, prefetch: int = 8) -> grain.DatasetIterator:
  """Iterator over task examples (dicts with an 'index'; with 'prompt_ids' when a tokenizer is given).

  train: index space range(num_examples) (default 2**24), example i = task.sample((problem_seed, 1, i)),
    shuffled by `seed` and reshuffled each epoch, repeated forever unless num_epochs is set. A file-backed
    task (task.train_examples() is a list) gives its rows instead, 'index' = the row's position.
  eval: the fixed distinct set task.eval_set(num_examples, problem_seed) (default 256 problems), in order,
    one epoch unless num_epochs is set.
  batch_size: None yields single examples; else lists of batch_size examples (remainder dropped).
  Shards (default: jax process index/count) take disjoint strided slices of the shuffled order.
  `it.get_state()` / `it.set_state(state)` resume the exact order (states are JSON-serialisable dicts).
  """
  if split not in tasks_base.SPLITS:
    raise ValueError(f"split must be one of {tasks_base.SPLITS}, got {split!r}")
  _check_positive("batch_size", batch_size, allow_none=True)
  _check_positive("num_examples", num_examples, allow_none=True)
  _check_positive("num_epochs", num_epochs, allow_none=True)
  shard_index, shard_count = _shard_args(shard_index, shard_count)
  problem_seed = seed if problem_seed is None else problem_seed
  _check_seed("seed", seed)
  _check_seed("problem_seed", problem_seed)
  rows = task.train_examples() if split == "train" else None
  if rows is not None:  # a file-backed task: its rows, shuffled by epoch
    ds = grain.MapDataset.source([_with_ids({**e, "index": i}, tokenizer) for i, e in enumerate(rows)])
    shuffle = True
  elif split == "train":
    ds = grain.MapDataset.range(num_examples or DEFAULT_NUM_EXAMPLES).map(
        _PromptAt(task, problem_seed, tokenizer))
    shuffle = True
  else:
    eval_set = task.eval_set(num_examples or 256, seed=problem_seed)
    ds = grain.MapDataset.source([_with_ids({**e, "index": i}, tokenizer) for i, e in enumerate(eval_set)])
    shuffle, num_epochs = False, num_epochs or 1
  # The map sits before the shuffle on purpose: the example is a function of its index, not of its position.
  ds = _ordered(ds, seed=seed, shuffle=shuffle, shard_index=shard_index, shard_count=shard_count,
                num_epochs=num_epochs)
  return _to_iter(ds, batch_size, list, prefetch)


def encode_sft_example(tokenizer: Tokenizer, prompt: str, completion: str, seq_len: int,
                       env: multiturn.Environment | None = None,
                       example: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded [prompt | completion <|im_end|> | pad] and its mask: 1 exactly on the completion's generated
  tokens + stop. With a tool environment (task.environment()) the completion is a multi-turn trace, cut and
  encoded segment by segment as episodes are (multiturn.trace_segments): tool replies get mask 0, since the
  model never generates them (the replies of an episode's environment started from `example`)."""
  prompt_ids = tokenizer.encode(prompt)
  segments = [(completion, False)] if env is None else multiturn.trace_segments(env, completion, example)
  response_ids, response_mask = [], []
  for text, is_tool in segments:
    ids = tokenizer.encode(text)
    response_ids += ids
    response_mask += [0.0 if is_tool else 1.0] * len(ids)
  response_ids.append(tokenizer.eos_id)
  response_mask.append(1.0)
  length = len(prompt_ids) + len(response_ids)
  if length > seq_len:
    raise ValueError(f"seq_len={seq_len} is shorter than prompt + completion ({length} tokens)")
  tokens_T = np.full((seq_len,), tokenizer.pad_id, np.int32)
  tokens_T[:length] = prompt_ids + response_ids
  mask_T = np.zeros((seq_len,), np.float32)
  mask_T[len(prompt_ids):length] = response_mask
  return tokens_T, mask_T


class _SftRow:
  """example (with its 'index') -> one encoded SFT row; a pure function of (knobs, seed, index, example)."""

  def __init__(self, task, tokenizer, seed, seq_len, error_rate):
    self.task, self.tokenizer, self.seed = task, tokenizer, seed
    self.seq_len, self.error_rate = seq_len, error_rate

  def __call__(self, example: dict, index: int | None = None) -> dict:
    index = example["index"] if index is None else index
    rng = np.random.default_rng([self.seed, _STREAM_SFT_COMPLETION, int(index)])
    completion = self.task.sft_completion(example, rng, self.error_rate)
    tokens_T, mask_T = encode_sft_example(self.tokenizer, example["prompt"], completion, self.seq_len,
                                          env=self.task.environment(), example=example)
    return {"tokens": tokens_T, "mask": mask_T,
            "reward": np.float32(self.task.reward(example, completion))}


class _SftAt(_SftRow):
  """index -> one encoded SFT row of a generated task; a pure function of (knobs, seeds, index)."""

  def __init__(self, task, tokenizer, problem_seed, seed, seq_len, error_rate):
    super().__init__(task, tokenizer, seed, seq_len, error_rate)
    self.problem_seed = problem_seed

  def __call__(self, index: int) -> dict:
    example = self.task.sample([self.problem_seed, _STREAM_SFT, int(index)], 1, split="train")[0]
    return super().__call__(example, index)


def _stack(rows: Sequence[dict]) -> dict:
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def make_sft_iterator(task: tasks_base.Task, tokenizer: Tokenizer, *, seed: int, batch_size: int,
                      seq_len: int, error_rate: float = 0.0, shard_index: int | None = None,
                      shard_count: int | None = None, num_examples: int | None = None,
                      problem_seed: int | None = None, prefetch: int = 8) -> grain.DatasetIterator:
  """Infinite iterator of SFT batches {'tokens': int32[B, T], 'mask': float32[B, T], 'reward': float32[B]}.

  Problems come from the train split (a different seed stream from make_prompt_iterator's; a file-backed task's
  task.sft_examples(), shuffled by epoch); with
  probability error_rate a completion is a plausible wrong answer (its 'reward' is then 0). A tool task's
  traces have mask 0 on the tool's replies (encode_sft_example).
  positions are arange(T) (right padding), so none are returned.
  """
  _check_positive("batch_size", batch_size)
  _check_positive("seq_len", seq_len)
  if not 0.0 <= error_rate <= 1.0:
    raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
  shard_index, shard_count = _shard_args(shard_index, shard_count)
  problem_seed = seed if problem_seed is None else problem_seed
  _check_seed("seed", seed)
  _check_seed("problem_seed", problem_seed)
  rows = task.sft_examples()
  if rows is None:
    ds = grain.MapDataset.range(num_examples or DEFAULT_NUM_EXAMPLES).map(
        _SftAt(task, tokenizer, problem_seed, seed, seq_len, error_rate))
  else:  # a file-backed task: its rows, shuffled by epoch
    ds = grain.MapDataset.source([{**e, "index": i} for i, e in enumerate(rows)]).map(
        _SftRow(task, tokenizer, seed, seq_len, error_rate))
  ds = _ordered(ds, seed=seed, shuffle=True, shard_index=shard_index, shard_count=shard_count,
                num_epochs=None)
  return _to_iter(ds, batch_size, _stack, prefetch)


def save_iterator_state(it: grain.DatasetIterator, path: str | os.PathLike) -> None:
  """Writes it.get_state() as JSON (atomically), for runs that do not use orbax."""
  tmp = f"{os.fspath(path)}.tmp"
  with open(tmp, "w") as f:
    json.dump(it.get_state(), f)
  os.replace(tmp, path)


def restore_iterator_state(it: grain.DatasetIterator, path: str | os.PathLike) -> grain.DatasetIterator:
  if not os.path.exists(path):
    raise ValueError(f"iterator state file does not exist: {os.fspath(path)!r}")
  with open(path) as f:
    it.set_state(json.load(f))
  return it
