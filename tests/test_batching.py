"""Rollout groups -> the learner's RLBatch: alignment of tokens, masks, log-probs, versions; bad input rejected."""
import asyncio

import numpy as np
import pytest

from vcpo_jax.learner.batch import RLBatch, check_batch
from vcpo_jax.job import batching
from vcpo_jax.rollout import group_metrics, rewards, types


def score(group, reward_fn, decode=str):
  """The group scored as a backend scores it (the job's Rewarder, here on the calling thread)."""
  return asyncio.run(rewards.inline(reward_fn, decode).score_group(group))


def _group(index, prompt, outputs, versions, lag):
  samples = [types.Sample(prompt_ids=list(prompt), output_ids=list(o), output_logprobs=-np.arange(1, len(o) + 1,
                                                                                                   dtype=np.float32),
                           token_versions=np.asarray(v), finish_reason="stop", server_url="x")
             for o, v in zip(outputs, versions)]
  g = types.Group(index=index, example={"prompt_ids": list(prompt), "want": len(outputs[0])},
                      start_version=0, deadline=lag, samples=samples, consumed_version=lag)
  g.sample_lags = [lag] * len(samples)
  return g


def test_rows_are_aligned_and_padded():
  groups = [_group(7, [1, 2, 3], [[4, 5], [6]], [[0, 1], [1]], 1), _group(9, [8], [[9, 9, 9], [5]], [[2, 2, 2], [2]], 0)]
  for g in groups:
    score(g, lambda ex, text: float(len(text) == ex["want"]), decode=lambda ids: "".join(map(str, ids)))
  arr = batching.groups_to_batch(groups, seq_len=6, pad_id=0, num_rows=6, vocab_size=10)
  np.testing.assert_array_equal(arr.tokens_BxT[0], [1, 2, 3, 4, 5, 0])
  np.testing.assert_array_equal(arr.mask_BxT[0], [0, 0, 0, 1, 1, 0])
  np.testing.assert_array_equal(arr.sampler_logp_BxT[0], [0, 0, 0, -1, -2, 0])
  np.testing.assert_array_equal(arr.version_BxT[0], [-1, -1, -1, 0, 1, -1])
  np.testing.assert_array_equal(arr.mask_BxT[2], [0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(arr.rewards_B, [1, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(arr.valid_B, [1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(arr.lag_B[:4], [1, 1, 0, 0])
  # Padding rows never share a group id with real rows or with each other.
  assert len(set(arr.group_B.tolist())) == 4 and arr.group_B[0] == arr.group_B[1] != arr.group_B[2]
  assert [g.index for g in groups] == [7, 9]  # prompt indices travel on the groups, not in the batch


def test_bad_rows_are_rejected_with_the_reason():
  kw = dict(seq_len=6, pad_id=0, vocab_size=10)
  scored = lambda g: score(g, lambda e, text: 0.0)  # noqa: E731
  with pytest.raises(ValueError, match="token id 12"):
    batching.groups_to_batch([scored(_group(0, [1], [[12]], [[0]], 0))], **kw)
  bad = scored(_group(3, [1], [[2, 3]], [[0, 0]], 0))
  bad.samples[0].output_logprobs[1] = np.nan
  with pytest.raises(ValueError, match="group 3.*non-finite"):
    batching.groups_to_batch([bad], **kw)
  with pytest.raises(ValueError, match="seq_len=6"):
    batching.groups_to_batch([scored(_group(0, [1, 2, 3, 4], [[5, 6, 7]], [[0, 0, 0]], 0))], **kw)


def test_unscored_groups_are_rejected():
  """Rewards are the backend's job (scored as each group completes); batch assembly never calls a reward."""
  with pytest.raises(ValueError, match="group 4 is not scored"):
    batching.groups_to_batch([_group(4, [1], [[2]], [[0]], 0)], seq_len=6, pad_id=0)


def test_batch_is_the_learners_type():
  g = score(_group(0, [1], [[2]], [[0]], 0), lambda e, text: 1.0)
  batch = batching.groups_to_batch([g], seq_len=4, pad_id=0, num_rows=2)
  assert isinstance(batch, RLBatch)
  check_batch(batch)
  assert batch.lag_B.dtype == np.float32 and batch.version_BxT.dtype == np.int32


def _scored_groups():
  groups = [_group(7, [1, 2, 3], [[4, 5], [6]], [[0, 1], [1]], 1), _group(9, [8], [[9, 9, 9], [5]], [[2, 2, 2], [2]], 0)]
  groups[1].samples[0].output_mask = np.asarray([1, 0, 1], np.float32)  # a tool-output token inside
  for g in groups:
    score(g, lambda ex, ids: float(len(ids)) / 4, decode=list)
  return groups


def test_next_batch_is_the_backends_groups_as_rows():
  """One process: the loop's one call gives the backend's groups and exactly groups_to_batch's rows."""
  import asyncio

  class Backend:
    async def next_groups(self, version):
      self.version = version
      return groups

  groups, backend = _scored_groups(), Backend()
  layout = batching.BatchLayout(seq_len=6, pad_id=0, num_rows=6, vocab_size=10)
  got_groups, batch = asyncio.run(batching.next_batch(backend, 3, layout))
  assert got_groups is groups and backend.version == 3
  want = batching.groups_to_batch(groups, seq_len=6, pad_id=0, num_rows=6, vocab_size=10)
  for name in RLBatch.__dataclass_fields__:
    np.testing.assert_array_equal(getattr(batch, name), getattr(want, name), err_msg=name)


def test_batch_metrics_equal_the_rows_statistics():
  """Reward and length statistics from the groups equal those of the valid rows (generated tokens only)."""
  groups = _scored_groups()
  rows = batching.groups_to_batch(groups, seq_len=6, pad_id=0, num_rows=6)
  valid = rows.valid_B > 0
  lengths = rows.mask_BxT.sum(axis=1)[valid]
  m = group_metrics.batch_metrics(groups, 2.0)
  assert m["reward/mean"] == float(rows.rewards_B[valid].mean())
  assert m["reward/std"] == float(rows.rewards_B[valid].std())
  assert m["response_length/mean"] == float(lengths.mean()) == 1.5  # 2, 1, 2 (3 tokens, one a tool output), 1
  assert m["throughput/tokens_per_s"] == float(lengths.sum() / 2.0) and m["throughput/step_seconds"] == 2.0


def test_step_metrics_are_the_three_kinds_together():
  """The loop's one call: reward/length/throughput, tool-episode and lag metrics, each as computed alone."""
  groups = _scored_groups()
  m = group_metrics.step_metrics(groups, seconds=2.0, max_lag=3)
  parts = (group_metrics.batch_metrics(groups, 2.0), group_metrics.episode_metrics(groups),
           group_metrics.lag_metrics(groups, 3))
  assert all(parts) and m == {k: v for part in parts for k, v in part.items()}
  assert sum(len(p) for p in parts) == len(m)
