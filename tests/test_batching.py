"""Rollout groups -> learner arrays: alignment of tokens, masks, log-probs, versions; bad input rejected."""
import numpy as np
import pytest

from vcpo_jax.rollout import batching, types


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
  arr = batching.groups_to_arrays(groups, seq_len=6, pad_id=0, decode=lambda ids: "".join(map(str, ids)),
                                  reward_fn=lambda ex, text: float(len(text) == ex["want"]), num_rows=6,
                                  vocab_size=10)
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
  assert arr.indices == [7, 9]


def test_bad_rows_are_rejected_with_the_reason():
  kw = dict(seq_len=6, pad_id=0, decode=str, reward_fn=lambda e, t: 0.0, vocab_size=10)
  with pytest.raises(ValueError, match="token id 12"):
    batching.groups_to_arrays([_group(0, [1], [[12]], [[0]], 0)], **kw)
  bad = _group(3, [1], [[2, 3]], [[0, 0]], 0)
  bad.samples[0].output_logprobs[1] = np.nan
  with pytest.raises(ValueError, match="group 3.*non-finite"):
    batching.groups_to_arrays([bad], **kw)
  with pytest.raises(ValueError, match="seq_len=6"):
    batching.groups_to_arrays([_group(0, [1, 2, 3, 4], [[5, 6, 7]], [[0, 0, 0]], 0)], **kw)
