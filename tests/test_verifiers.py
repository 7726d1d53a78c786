"""Verifiers: math (math-verify) on known equivalent and non-equivalent answers, gsm8k, exact, numeric, a user's
module:function; every one picklable, math-verify's timeouts on only in a main thread."""
import concurrent.futures
import multiprocessing
import pickle
import sys
import textwrap
import threading

import pytest

from vcpo_jax.tasks.files import verifiers


def _ex(gt):
  return {"ground_truth": gt}


# (ground truth, completion, reward): answers as MATH writes them against answers as models write them.
MATH_TABLE = [
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),                      # fraction vs decimal
    ("0.5", "so \\boxed{\\frac12}", 1.0),                                    # decimal vs shorthand \frac
    ("\\frac{1}{2}", "\\boxed{1/2}", 1.0),                                   # LaTeX vs plain fraction
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0),                          # \dfrac
    ("\\frac{1}{3}", "\\boxed{0.3333333}", 1.0),                              # rounded decimal
    ("\\frac{1}{3}", "\\boxed{0.333}", 0.0),                                  # too coarse
    ("(1, 3]", "\\boxed{(1,3]}", 1.0),                                       # interval
    ("(1, 3]", "\\boxed{[1,3]}", 0.0),                                       # other endpoints
    ("(-\\infty, 2)", "\\boxed{(-\\infty,2)}", 1.0),                          # unbounded interval
    ("\\{1, 2\\}", "\\boxed{\\{2,1\\}}", 1.0),                                # set, any order
    ("\\{1,2\\}", "\\boxed{\\{1,3\\}}", 0.0),                                 # other set
    ("(1,2)", "\\boxed{(2,1)}", 0.0),                                        # ordered pair, swapped
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),                                  # symbolic equivalence
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),                                   # expanded vs factored
    ("10", "The answer is \\boxed{10 \\text{ dollars}}.", 1.0),              # text/units around
    ("10", "\\boxed{10\\text{ cm}}", 1.0),
    ("1000", "\\boxed{1,000}", 1.0),                                         # thousands separator
    ("5", "\\boxed{\\boxed{5}}", 1.0),                                       # nested braces
    ("\\frac{a}{b}", "first \\boxed{\\frac{a}{b}}", 1.0),                     # braces inside the box
    ("2", "We get $2$.", 1.0),                                               # LaTeX inline, no box
    ("50\\%", "\\boxed{0.5}", 1.0),                                          # percent
    ("72", "\\boxed{73}", 0.0),                                              # wrong
    ("-3", "\\boxed{3}", 0.0),                                               # sign
    ("\\pi", "\\boxed{3.14}", 0.0),                                          # approximation
    ("72", "no answer here", 0.0),                                           # nothing to parse
    ("\\boxed{7}", "so \\boxed{7}", 1.0),                                    # a gold already boxed
]


@pytest.mark.parametrize("gt,completion,want", MATH_TABLE)
def test_math_verifier_table(gt, completion, want):
  assert verifiers.build_verifier("math")(_ex(gt), completion) == want


def test_math_verifier_runs_in_a_thread_without_signal_timeouts(monkeypatch):
  import math_verify
  seen = []
  parse, verify = math_verify.parse, math_verify.verify
  monkeypatch.setattr(math_verify, "parse", lambda text, **kw: seen.append(("parse", kw["parsing_timeout"]))
                      or parse(text, **kw))
  monkeypatch.setattr(math_verify, "verify", lambda g, p, **kw: seen.append(("verify", kw["timeout_seconds"]))
                      or verify(g, p, **kw))
  fn = verifiers.build_verifier("math", {"math": {"timeout_seconds": 7}})
  assert fn(_ex("\\frac{1}{2}"), "\\boxed{0.5}") == 1.0
  assert seen == [("parse", 7), ("parse", 7), ("verify", 7)]
  seen.clear()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    assert pool.submit(fn, _ex("\\frac{1}{2}"), "\\boxed{0.5}").result() == 1.0
  assert seen == [("parse", None), ("parse", None), ("verify", None)]
  assert threading.current_thread() is threading.main_thread()


@pytest.mark.integration
def test_verifiers_run_in_spawned_worker_processes():
  fns = [verifiers.build_verifier(name) for name in ("math", "gsm8k", "exact", "numeric")]
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
    got = list(pool.map(lambda_free_call, fns, [_ex("12")] * 4, ["\\boxed{12}"] * 4))
  assert got == [1.0, 1.0, 1.0, 1.0]


def lambda_free_call(fn, example, completion):
  return fn(example, completion)


@pytest.mark.parametrize("completion,strict,flexible", [
    ("so 8 + 64 = 72\n#### 72", 1.0, 1.0),
    ("#### 72.00", 1.0, 1.0),
    ("#### $72", 1.0, 1.0),
    ("#### 1,000 wait no\n#### 72", 1.0, 1.0),     # the last #### counts
    ("The answer is \\boxed{72}.", 1.0, 1.0),
    ("The answer is \\boxed{\\$72}.", 1.0, 1.0),
    ("She has 72 apples.", 0.0, 1.0),              # the last number: flexible only
    ("72 apples, no wait, 71.", 0.0, 0.0),
    ("#### 71", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_gsm8k_verifier(completion, strict, flexible):
  assert verifiers.build_verifier("gsm8k")(_ex("72"), completion) == strict
  assert verifiers.build_verifier("gsm8k", {"gsm8k": {"flexible": True}})(_ex("72"), completion) == flexible


def test_gsm8k_reads_a_ground_truth_in_gsm8ks_own_form():
  fn = verifiers.build_verifier("gsm8k")
  assert fn(_ex("Natalia sold 48/2 = 24 clips.\n#### 1,072"), "#### 1072") == 1.0
  assert fn(_ex("1,072"), "\\boxed{1072}") == 1.0


def test_exact_verifier():
  fn = verifiers.build_verifier("exact")
  assert fn(_ex("Paris"), "The capital is \\boxed{Paris}") == 1.0
  assert fn(_ex("New  York"), "<answer> New York </answer>") == 1.0   # whitespace collapsed
  assert fn(_ex("Paris"), "\\boxed{paris}") == 0.0
  assert verifiers.build_verifier("exact", {"exact": {"case_sensitive": False}})(_ex("Paris"), "\\boxed{paris}") == 1.0
  assert fn(_ex("yes"), "  yes \n") == 1.0                            # no box: the whole completion
  assert fn(_ex("yes"), "I think yes") == 0.0


def test_numeric_verifier_tolerances():
  default = verifiers.build_verifier("numeric")
  assert default(_ex("3.14159"), "\\boxed{3.1415905}") == 1.0
  assert default(_ex("3.14159"), "\\boxed{3.1416}") == 0.0
  assert default(_ex("0.75"), "\\boxed{\\frac{3}{4}}") == 1.0
  assert default(_ex("0.75"), "\\boxed{3/4}") == 1.0
  assert default(_ex("1e3"), "<answer>1,000</answer>") == 1.0
  assert default(_ex("12"), "12") == 0.0                               # no final answer
  loose = verifiers.build_verifier("numeric", {"numeric": {"rel_tol": 0.01, "last_number": True}})
  assert loose(_ex("100"), "about 100.9") == 1.0
  assert loose(_ex("100"), "about 102") == 0.0


def test_parse_number():
  pn = verifiers.parse_number
  assert pn("1,000") == 1000 and pn("-2.5") == -2.5 and pn("\\frac{-3}{4}") == -0.75 and pn("$12.") == 12
  assert pn("50\\%") == 50 and pn("10\\text{ cm}") == 10
  assert pn("x") is None and pn("1/0") is None and pn("") is None and pn(None) is None
  assert pn("1" * 100) is None


def test_verifier_options_parse_and_errors():
  assert verifiers.parse_options("numeric.abs_tol=0.01, gsm8k.flexible=true,math.timeout_seconds=3", "f") == {
      "numeric": {"abs_tol": 0.01}, "gsm8k": {"flexible": True}, "math": {"timeout_seconds": 3}}
  with pytest.raises(ValueError, match=r"f='abs_tol=1'.*<verifier>.<option>=<value>"):
    verifiers.parse_options("abs_tol=1", "f")
  with pytest.raises(ValueError, match=r"task.verifier='numeric': bad options.*unknown option\(s\) \['tol'\]"):
    verifiers.build_verifier("numeric", {"numeric": {"tol": 1}}, field="task.verifier")
  with pytest.raises(ValueError, match=r"task.verifier='maths': unknown verifier; known: \['exact', 'gsm8k', "
                     r"'math', 'numeric'\]"):
    verifiers.build_verifier("maths", field="task.verifier")


def test_built_verifiers_pickle_and_keep_their_options():
  fn = verifiers.build_verifier("numeric", {"numeric": {"abs_tol": 0.5}})
  back = pickle.loads(pickle.dumps(fn))
  assert back(_ex("10"), "\\boxed{10.4}") == 1.0 and back(_ex("10"), "\\boxed{10.6}") == 0.0


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
      def contains(example, completion):
        return 1.0 if example["ground_truth"] in completion else 0.0
      scaled = lambda example, completion: 0.5
      def one_arg(example):
        return 1.0
      NOT_A_FUNCTION = 3
  """))
  monkeypatch.syspath_prepend(str(tmp_path))
  yield "my_rewards"
  sys.modules.pop("my_rewards", None)


def test_user_function_loads_and_scores(user_module):
  fn = verifiers.build_verifier(f"{user_module}:contains", field="task.options.dataset.verifier")
  assert fn(_ex("42"), "it is 42") == 1.0 and fn(_ex("42"), "it is 41") == 0.0
  assert pickle.loads(pickle.dumps(fn)) is fn


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
    ("my_rewards:missing", r"module 'my_rewards' has no attribute 'missing'"),
    ("my_rewards:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function"),
    ("my_rewards:one_arg", r"one_arg must take \(example, completion\)"),
    ("my_rewards:scaled", r"scaled is not picklable"),
    ("my_rewards:", r"a user verifier is written 'module:function'"),
])
def test_user_function_errors_name_the_field_and_value(user_module, spec, message):
  with pytest.raises(ValueError, match=rf"task.options.dataset.verifier='{spec}': .*{message}"):
    verifiers.build_verifier(spec, field="task.options.dataset.verifier")
