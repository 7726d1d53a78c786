"""Held-out evaluation: greedy once per problem, the sampled accuracy over task.eval_samples draws per problem."""
import numpy as np
import pytest

from vcpo_jax import tasks
from vcpo_jax.job import evaluation
from vcpo_jax.model.tokenizer import build_tokenizer, completion_text
from vcpo_jax.rollout import rewards, types


def test_sampled_accuracy_averages_every_draw_of_every_problem(monkeypatch):
  tok, task = build_tokenizer(), tasks.get_task("countdown", num_numbers=2, max_number=25)
  examples = task.eval_set(3, seed=0)
  calls = []

  def generate(params, model_cfg, prompts, *, temperature, **kw):
    calls.append((temperature, list(prompts)))
    # Draw j of a problem answers correctly iff j is even (greedy: always correct).
    out = []
    for i, _ in enumerate(prompts):
      ex = examples[i // (1 if temperature == 0 else 4)]
      right = temperature == 0 or (i % 4) % 2 == 0
      text = task.reference_solution(ex) if right else "<answer>0</answer>"
      out.append(types.Sample(prompt_ids=[], output_ids=tok.encode(text), output_logprobs=np.zeros(0),
                              token_versions=np.zeros(0), finish_reason="stop", server_url=""))
    return out

  monkeypatch.setattr(evaluation.sampling, "generate", generate)
  rewarder = rewards.inline(task.reward_function(), lambda ids: completion_text(tok, ids))
  got = evaluation.evaluate(None, None, tok, task, examples, rewarder=rewarder, max_new_tokens=8, seed=0, samples=4)
  # Each problem: 2 of 4 draws right, so pass@2 = 1 - C(2, 2) / C(4, 2) = 5/6 (no data_source: overall only).
  assert got == pytest.approx({"eval/greedy_accuracy": 1.0, "eval/sampled_accuracy": 0.5, "eval/greedy/pass@1": 1.0,
                               "eval/avg@4": 0.5, "eval/pass@1": 0.5, "eval/pass@2": 5 / 6, "eval/pass@4": 1.0})
  (t0, greedy), (t1, sampled) = calls
  assert (t0, t1) == (0.0, 1.0) and len(greedy) == 3 and len(sampled) == 12
  want = [tok.encode(e["prompt"]) for e in examples for _ in range(4)]  # a problem's draws side by side
  assert [list(p) for p in sampled] == [list(p) for p in want]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sample_count_names_the_field(bad):
  with pytest.raises(ValueError, match="task.eval_samples"):
    evaluation.evaluate(None, None, build_tokenizer(), tasks.get_task("countdown"), [], rewarder=None,
                        max_new_tokens=8, seed=0, samples=bad)
