"""docs/extend.md's worked examples run as written and compute what the page says (float64 numpy, a real worker
process); the choices they register are unregistered afterwards, so no other test's registry listing sees them."""
import collections
import contextlib
import pathlib
import re
import shutil
import sys

import jax
import numpy as np
import pytest

from vcpo_jax.algo import advantages, losses, policy_losses, vcpo
from vcpo_jax.learner import config, grad_path
from vcpo_jax.model import transformer

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "extend.md"
SETUP, LOSS, ESTIMATOR, TASK, REWARD = ("A tiny model to try things on", "A new policy loss",
                                        "A new advantage estimator", "A task from your files",
                                        "Your reward function")
REGISTRIES = (policy_losses.LOSSES, advantages.ESTIMATORS)


def _blocks() -> dict[str, str]:
  """Section heading -> the section's python block (exactly one each)."""
  out = {}
  for section in DOC.read_text().split("\n## ")[1:]:
    heading, body = section.split("\n", 1)
    code = re.findall(r"```python\n(.*?)```", body, re.S)
    if code:
      assert len(code) == 1, f"docs/extend.md: section {heading!r} has {len(code)} python blocks"
      out[heading.strip()] = code[0]
  return out


@contextlib.contextmanager
def _page():
  """Yields run(*headings), which executes those sections' blocks in page order in one namespace and returns
  it; on exit the choices they registered, their temporary directory, sys.path entry and module are removed."""
  before = [set(r.names()) for r in REGISTRIES]
  namespace: dict = {}
  blocks = _blocks()

  def run(*headings):
    for heading in [h for h in blocks if h in headings]:
      exec(compile(blocks[heading], str(DOC), "exec"), namespace)  # noqa: S102 - the project's own docs
    return namespace

  try:
    yield run
  finally:
    for registry, names in zip(REGISTRIES, before):
      for name in set(registry.names()) - names:
        registry.unregister(name)
    if "data" in namespace:
      data = str(namespace["data"])
      if data in sys.path:
        sys.path.remove(data)
      sys.modules.pop("my_rewards", None)
      shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def run_page():
  with _page() as run:
    yield run


def test_every_section_has_its_example():
  assert list(_blocks()) == [SETUP, LOSS, ESTIMATOR, TASK, REWARD]


def _logp64(ns):
  """float64 log-probs of the toy batch under one_step's initial params."""
  opt = ns["optimizer"].build_optimizer(learning_rate=1e-3)
  params = ns["train_state"].create_train_state(ns["MODEL"], opt, jax.random.PRNGKey(0)).params
  batch = ns["toy_batch"]()
  logp = transformer.token_logprobs(params, ns["MODEL"], batch.tokens_BxT, batch.mask_BxT)
  return np.asarray(logp, np.float64), batch


def test_policy_loss_example(run_page):
  ns = run_page(SETUP, LOSS)
  assert "example_capped_is" in losses.POLICY_LOSSES
  logp, batch = _logp64(ns)
  m, mu, r = (np.asarray(x, np.float64) for x in (batch.mask_BxT, batch.sampler_logp_BxT, batch.rewards_B))
  adv = np.zeros_like(r)
  for g in np.unique(batch.group_B):  # GRPO: unbiased std (verl)
    rows = batch.group_B == g
    adv[rows] = (r[rows] - r[rows].mean()) / (r[rows].std(ddof=1) + vcpo.GRPO_EPS)
  cap = ns["capped_cfg"].loss_options().cap   # the page's choice
  w = np.minimum(np.exp(logp - mu), cap)
  want = np.mean(np.sum(-w * adv[:, None] * logp * m, axis=1) / m.sum(axis=1))   # seq-mean-token-mean
  metrics = ns["metrics"]
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss/capped_frac"], np.sum((w >= cap) * m) / m.sum(), rtol=1e-6)
  assert 0 < metrics["loss/capped_frac"] < 1 and metrics["update_applied"] == 1
  # What the page says about the facts and the options.
  assert grad_path.choose(config.LearnerConfig(policy_loss="example_capped_is"), ns["MODEL"], 8, 12)[0] == "bounded"
  assert config.LearnerConfig(policy_loss="example_capped_is", micro_batch_size=4).chunkable
  with pytest.raises(ValueError, match=r"'cpa'.*known options: \['cap'\]"):
    config.LearnerConfig(policy_loss="example_capped_is", policy_loss_options={"cpa": 1.0})


@pytest.mark.slow
def test_advantage_estimator_example(run_page):
  ns = run_page(SETUP, ESTIMATOR)
  batch = ns["toy_batch"]()
  r, lengths = np.asarray(batch.rewards_B, np.float64), np.asarray(batch.mask_BxT, np.float64).sum(axis=1)
  penalty = ns["length_cfg"].estimator_options().penalty   # the page's choice
  shaped = r - penalty * lengths
  adv = shaped - np.array([shaped[batch.group_B == g].mean() for g in batch.group_B])
  np.testing.assert_allclose(ns["metrics"]["adv/abs_mean"], np.abs(adv).mean(), rtol=1e-5)
  np.testing.assert_allclose(ns["metrics"]["shaped_reward"], shaped.mean(), rtol=1e-5)
  assert ns["length_cfg"].group_local and ns["metrics"]["update_applied"] == 1
  # A padding row gets 0 and leaves its group's mean alone.
  valid = np.ones(8, bool)
  valid[3] = False
  inputs = advantages.AdvantageInputs(rewards_B=batch.rewards_B, group_B=batch.group_B, lengths_B=lengths,
                                      valid_B=valid)
  got, _ = losses.compute_advantages("example_length_penalty", inputs, {"penalty": penalty})
  first = np.arange(8) < 4
  want = np.where(first & valid, shaped - shaped[first & valid].mean(), adv) * valid
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
  with pytest.raises(ValueError, match="batch-global"):
    config.LearnerConfig(advantage="reinforce", policy_loss="pg", micro_batch_size=4)


def test_examples_leave_the_registries_as_they_were():
  before = (losses.POLICY_LOSSES.names(), losses.ADVANTAGE_ESTIMATORS.names())
  with _page() as run:
    run(SETUP)["one_step"] = lambda learner_cfg: collections.defaultdict(float)   # registration only, no step
    run(LOSS, ESTIMATOR)
    assert "example_capped_is" in losses.POLICY_LOSSES and "example_length_penalty" in losses.ADVANTAGE_ESTIMATORS
  assert (losses.POLICY_LOSSES.names(), losses.ADVANTAGE_ESTIMATORS.names()) == before
  with pytest.raises(ValueError, match="unknown policy loss name='example_capped_is'"):
    losses.POLICY_LOSSES.unregister("example_capped_is")


def test_task_from_files_example(run_page):
  ns = run_page(TASK)
  task = ns["task"]
  assert [ex["ground_truth"] for ex in task.train_examples()] == ["7", "42"]
  assert ns["example"]["ground_truth"] == "15" and ns["example"]["data_source"] == "test"
  assert "Tom has 7 apples and buys 8 more." in ns["example"]["prompt"]
  assert ns["rewards"] == [1.0, 0.0]


@pytest.mark.integration  # reward worker processes
def test_reward_function_example(run_page):
  ns = run_page(TASK, REWARD)
  assert ns["scores"] == [1.0, 0.5, 0.0]   # only my_rewards.right_and_short gives 0.5: the workers imported it
  stats = ns["rewarder"].stats()
  assert stats["reward/calls"] == 3 and not any(v for k, v in stats.items() if k.startswith("reward/errors/"))
  assert ns["rewarder"].pool.kind == "process"
