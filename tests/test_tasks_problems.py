"""Tests for tasks' problems: generators, knobs, splits, the solver, reference and SFT completions, registry errors,
warm-start traces."""
import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from vcpo_jax import tasks
from vcpo_jax.model.tokenizer import build_tokenizer
from vcpo_jax.tasks import countdown, safe_eval

TOK = build_tokenizer()


# --- generators, knobs, splits -------------------------------------------------------------------------------

KNOB_SETS = [("countdown", {}), ("countdown", {"min_numbers": 3, "max_numbers": 3, "max_number": 20}),
             ("countdown", {"min_numbers": 4, "max_numbers": 4, "ops": "+-"}),
             ("arithmetic", {}), ("arithmetic", {"min_digits": 4, "max_digits": 6, "ops": "*"})]


@pytest.mark.parametrize("name,knobs", KNOB_SETS)
def test_sampling_is_deterministic_by_seed_and_json_serialisable(name, knobs):
  task = tasks.get_task(name, **knobs)
  a, b, c = task.sample(7, 30), task.sample(7, 30), task.sample(8, 30)
  assert a == b
  assert [e["key"] for e in a] != [e["key"] for e in c]
  assert json.loads(json.dumps(a)) == a
  rng = np.random.default_rng(7)
  assert task.sample(rng, 15) + task.sample(rng, 15) == a  # a Generator continues its stream


@pytest.mark.parametrize("name,knobs", KNOB_SETS)
def test_every_problem_has_a_reference_solution_with_reward_one(name, knobs):
  task = tasks.get_task(name, **knobs)
  examples = task.sample(0, 60) + task.eval_set(20)
  for i, ex in enumerate(examples):
    completion = task.reference_solution(ex, i)
    assert task.reward(ex, completion) == 1.0, (ex, completion)
    assert TOK.decode(TOK.encode(ex["prompt"] + completion)) == ex["prompt"] + completion


def test_countdown_knobs_are_respected():
  task = tasks.get_task("countdown", min_numbers=3, max_numbers=4, min_number=5, max_number=40,
                        max_target=300)
  for ex in task.sample(1, 200):
    assert 3 <= len(ex["numbers"]) <= 4
    assert all(5 <= n <= 40 for n in ex["numbers"])
    assert 1 <= ex["target"] <= 300
    assert ex["prompt"].startswith("<|im_start|>user\n") and ex["prompt"].endswith("<|im_start|>assistant\n")
    assert f"equals {ex['target']}." in ex["prompt"]
  assert {len(e["numbers"]) for e in tasks.get_task("countdown", num_numbers=3, max_number=9).sample(0, 50)} == {3}
  for ex in tasks.get_task("countdown", ops="+").sample(2, 50):
    assert ex["target"] == sum(ex["numbers"])
    assert "with + and" in ex["prompt"]
  for ex in tasks.get_task("countdown", ops="*", max_number=9).sample(3, 50):
    assert ex["target"] == math.prod(ex["numbers"])


def test_arithmetic_knobs_are_respected():
  task = tasks.get_task("arithmetic", min_digits=2, max_digits=3, ops="+*")
  for ex in task.sample(1, 200):
    assert 10 <= ex["a"] <= 999 and 10 <= ex["b"] <= 999
    assert ex["op"] in "+*"
    assert f"Compute {ex['a']} {ex['op']} {ex['b']}." in ex["prompt"]


@pytest.mark.parametrize("name,knobs", [("countdown", {}), ("arithmetic", {}),
                                        ("countdown", {"num_numbers": 3, "max_number": 9})])  # ~2k problems
def test_eval_split_is_disjoint_from_train(name, knobs):
  task = tasks.get_task(name, **knobs)
  train = task.sample(0, 2000)
  evals = task.eval_set(128)
  assert len({e["key"] for e in evals}) == 128
  assert {e["key"] for e in train}.isdisjoint(e["key"] for e in evals)
  assert all(task.split_of(e) == "train" for e in train)
  assert all(task.split_of(e) == "eval" for e in evals)
  assert task.eval_set(128) == evals
  # The split is a property of the problem, not of the knobs or of the order of the numbers.
  other = tasks.get_task(name, **({"max_number": 50} if name == "countdown" else {"max_digits": 2}))
  assert all(other.split_of(e) == "eval" for e in evals)


def test_eval_set_too_large_for_the_knobs_raises():
  tiny = tasks.get_task("arithmetic", min_digits=1, max_digits=1, ops="+")  # 100 problems in all
  with pytest.raises(ValueError, match="n=50"):
    tiny.eval_set(50)


def _brute_force_solvable(numbers, target):
  """Independent of countdown.solve: every leaf order, every op choice, every tree shape."""
  def shapes(leaves):
    if len(leaves) == 1:
      yield Fraction(leaves[0])
      return
    for k in range(1, len(leaves)):
      for x in shapes(leaves[:k]):
        for y in shapes(leaves[k:]):
          yield x + y
          yield x - y
          yield x * y
          if y != 0:
            yield x / y
  return any(v == target for perm in itertools.permutations(numbers) for v in shapes(perm))


def test_solver_agrees_with_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(60):
    numbers = [int(n) for n in rng.integers(1, 12, size=int(rng.integers(3, 5)))]
    target = int(rng.integers(1, 60))
    expr = countdown.solve(numbers, target)
    assert (expr is not None) == _brute_force_solvable(numbers, target), (numbers, target)
    if expr is not None:
      assert countdown.countdown_reward(f"<answer>{countdown.render(expr)}</answer>", numbers, target) == 1.0
  assert countdown.solve([1, 1, 1], 100) is None


# --- SFT completions ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in sorted(tasks.TASKS) if not tasks.TASKS.get(n).fn.from_files])
def test_sft_completion_error_rate(name):
  task = tasks.get_task(name)
  examples = task.sample(5, 200)
  right = [tasks.sft_completion(e, i, error_rate=0.0) for i, e in enumerate(examples)]
  wrong = [tasks.sft_completion(e, i, error_rate=1.0) for i, e in enumerate(examples)]
  mixed = [tasks.sft_completion(e, i, error_rate=0.3) for i, e in enumerate(examples)]
  assert all(task.reward(e, c) == 1.0 for e, c in zip(examples, right))
  assert all(task.reward(e, c) == 0.0 for e, c in zip(examples, wrong))
  # Wrong answers are still well-formed: an answer block the tokenizer encodes.
  assert all(tasks.extract_answer(c) is not None and TOK.encode(c) for c in wrong)
  n_wrong = sum(task.reward(e, c) == 0.0 for e, c in zip(examples, mixed))
  assert abs(n_wrong - 60) < 5 * math.sqrt(200 * 0.3 * 0.7)
  assert mixed == [tasks.sft_completion(e, i, error_rate=0.3) for i, e in enumerate(examples)]


# --- registry and argument errors --------------------------------------------------------------------------

def test_registry_errors_name_the_field():
  with pytest.raises(ValueError, match="unknown task name 'gsm8k'.*arithmetic.*countdown"):
    tasks.get_task("gsm8k")
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_digits'\]"):
    tasks.get_task("countdown", max_digits=3)
  with pytest.raises(ValueError, match="min_numbers"):
    tasks.get_task("countdown", min_numbers=1)
  with pytest.raises(ValueError, match="max_numbers=6"):
    tasks.get_task("countdown", num_numbers=6)
  with pytest.raises(ValueError, match="ops"):
    tasks.get_task("countdown", ops="+^")
  with pytest.raises(ValueError, match="max_digits"):
    tasks.get_task("arithmetic", max_digits=0)
  with pytest.raises(ValueError, match="eval_fraction"):
    tasks.get_task("arithmetic", eval_fraction=0.0)
  task = tasks.get_task("countdown")
  with pytest.raises(ValueError, match="split"):
    task.sample(0, 1, split="test")
  with pytest.raises(ValueError, match="n must"):
    task.sample(0, -1)
  with pytest.raises(ValueError, match="error_rate"):
    task.sft_completion(task.sample(0, 1)[0], 0, error_rate=1.5)
  with pytest.raises(ValueError, match="no solution"):
    task.reference_solution({"task": "countdown", "numbers": [1, 1, 1], "target": 100})


# --- warm-start reasoning traces (Countdown trace_checks) -------------------------------------------------

def test_countdown_without_trace_checks_keeps_the_bare_answer():
  task = countdown.Countdown(num_numbers=2, max_number=25)
  for ex in task.sample(3, 20):
    rng = np.random.default_rng(5)
    text = task.reference_solution(ex, rng)
    assert text == f"<answer>{countdown.render(countdown.solve(ex['numbers'], ex['target'], ex['ops'], np.random.default_rng(5)))}</answer>"
    assert task.wrong_completion(ex, rng).count("\n") == 0


@pytest.mark.parametrize("knobs", [dict(num_numbers=2, max_number=40, trace_checks=5),
                                   dict(num_numbers=3, max_number=10, trace_checks=4)])
def test_countdown_trace_lines_are_exact_checks_then_the_answer(knobs):
  """Every check line's value is the expression's exact value (independent evaluator), no check hits the
  target, checks are distinct; the last line states the answer = target (a miscalculation in wrong traces)."""
  task = countdown.Countdown(**knobs)
  rng = np.random.default_rng(0)
  for ex in task.sample(1, 60):
    for text, want in ((task.reference_solution(ex, rng), 1.0), (task.wrong_completion(ex, rng), 0.0)):
      assert task.reward(ex, text) == want
      *checks, last, answer = text.split("\n")
      assert 1 <= len(checks) + 1 <= knobs["trace_checks"] + 1 and len(set(checks)) == len(checks)
      for line in checks:
        expr, v = line.split(" = ")
        assert safe_eval.evaluate(expr) == Fraction(v) != ex["target"]
        assert sorted(map(int, safe_eval.literals(expr))) == sorted(ex["numbers"])
      expr, claim = last.split(" = ")
      assert int(claim) == ex["target"] and answer == f"<answer>{expr}</answer>"
      if want:
        assert safe_eval.evaluate(expr) == ex["target"]


def test_countdown_trace_checks_make_long_responses():
  task = countdown.Countdown(num_numbers=2, max_number=40, trace_checks=5)
  lengths = [len(TOK.encode(task.reference_solution(ex, i))) for i, ex in enumerate(task.sample(2, 100))]
  assert np.mean(lengths) >= 60, np.mean(lengths)


@pytest.mark.parametrize("bad", [-1, 17, 2.0, True])
def test_countdown_trace_checks_out_of_range_is_refused(bad):
  with pytest.raises(ValueError, match="trace_checks"):
    countdown.Countdown(trace_checks=bad)
