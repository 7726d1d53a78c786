"""Answer verifiers registered by name (math, gsm8k, exact, numeric) or a user's `module:function`.

Every verifier is a picklable module-level callable `(example, completion) -> float` (options bound with
functools.partial), so a pool of worker processes can run it. It reads `example["ground_truth"]` (a string).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import pickle
import re
import threading
from fractions import Fraction
from typing import Any, Callable, Mapping

from vcpo_jax import registry
from vcpo_jax.tasks import base

Verifier = Callable[[dict, str], float]
VERIFIERS = registry.Registry("verifier", facts={})

# A number as written in an answer: sign, digits with optional thousands commas, decimals, exponent.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_FRAC_RE = re.compile(r"^(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}$")
# Decoration around a number that does not change it: dollars, percent signs, LaTeX spacing and text.
_DECORATION_RE = re.compile(r"\\text\{[^{}]*\}|\\(?:mathrm|textbf)\{[^{}]*\}|\\[,!;: ]|\\\$|[$%\s]|\\%")
MAX_NUMBER_CHARS = 64  # longer "numbers" are refused (Fraction of a huge decimal string is slow)


def ground_truth(example: Mapping[str, Any]) -> str:
  gt = example.get("ground_truth")
  if not isinstance(gt, str):
    raise ValueError(f"example has no string 'ground_truth' (got {gt!r}); keys: {sorted(example)}")
  return gt


def parse_number(text: str | None) -> Fraction | None:
  """The exact value of a numeric answer ('1,000', '-2.5', '3/4', '\\frac{3}{4}', '$12', '1e3'), else None."""
  if text is None:
    return None
  s = _DECORATION_RE.sub("", text).rstrip(".")
  if not s or len(s) > MAX_NUMBER_CHARS:
    return None
  m = _FRAC_RE.match(s)
  if m:
    num, den = int(m.group(2)), int(m.group(3))
    return None if den == 0 else Fraction(-num if m.group(1) else num, den)
  num, slash, den = s.partition("/")
  try:
    if slash:
      return Fraction(int(num), int(den)) if int(den) != 0 else None
    if not _NUMBER_RE.fullmatch(s):
      return None
    return Fraction(s.replace(",", ""))
  except (ValueError, ZeroDivisionError):
    return None


def last_number_text(text: str) -> str | None:
  found = _NUMBER_RE.findall(text)
  return found[-1] if found else None


# ----------------------------------------------------------------------------------------------- math
@dataclasses.dataclass(frozen=True)
class MathOptions:
  timeout_seconds: int = 5     # math-verify's own limit per parse and per verify (only in a main thread)
  float_rounding: int = 6      # decimals kept when comparing floats (math-verify)


def _in_main_thread() -> bool:
  # math-verify's timeouts use signal.alarm, which Python allows only in the main thread of a process.
  return threading.current_thread() is threading.main_thread()


@VERIFIERS.register("math", options=MathOptions)
def math_verifier(example: dict, completion: str, *, timeout_seconds: int = 5, float_rounding: int = 6) -> float:
  """math-verify: the gold answer (wrapped in \\boxed{} unless it has one) against the completion's answers
  (boxed first, then LaTeX and plain expressions), equal numerically, symbolically or as sets/intervals."""
  import math_verify  # noqa: PLC0415 - imported on first use (sympy is slow to import)
  timeout = timeout_seconds if _in_main_thread() else None
  gt = ground_truth(example)
  gold = math_verify.parse(gt if "\\boxed" in gt else f"\\boxed{{{gt}}}", parsing_timeout=timeout)
  pred = math_verify.parse(completion, parsing_timeout=timeout)
  if not gold or not pred:
    return 0.0
  return 1.0 if math_verify.verify(gold, pred, float_rounding=float_rounding, timeout_seconds=timeout) else 0.0


# ---------------------------------------------------------------------------------------------- gsm8k
@dataclasses.dataclass(frozen=True)
class Gsm8kOptions:
  flexible: bool = False       # also accept the completion's last number when it has no `####` or \boxed{}


def gsm8k_answer(completion: str, flexible: bool = False) -> str | None:
  """The number after the last `#### `, else the last \\boxed{}'s content, else (flexible) the last number."""
  found = _GSM8K_RE.findall(completion)
  if found:
    return found[-1]
  boxed = base.extract_answer(completion) if "\\boxed{" in completion else None
  if boxed is not None:
    return boxed
  return last_number_text(completion) if flexible else None


@VERIFIERS.register("gsm8k", options=Gsm8kOptions)
def gsm8k_verifier(example: dict, completion: str, *, flexible: bool = False) -> float:
  """Numeric equality (exact, as fractions: '72.0' = '72', '1,000' = '1000') of gsm8k_answer and the ground
  truth; a ground truth in GSM8K's own form ('... #### 72') is read the same way."""
  gt = ground_truth(example)
  gold = parse_number(gsm8k_answer(gt) or gt)
  got = parse_number(gsm8k_answer(completion, flexible))
  return 1.0 if gold is not None and got is not None and got == gold else 0.0


# ---------------------------------------------------------------------------------------------- exact
@dataclasses.dataclass(frozen=True)
class ExactOptions:
  case_sensitive: bool = True


def final_answer(completion: str) -> str:
  """The last \\boxed{} (else <answer></answer>) content, else the whole completion."""
  found = base.extract_answer(completion)
  return completion if found is None else found


@VERIFIERS.register("exact", options=ExactOptions)
def exact_verifier(example: dict, completion: str, *, case_sensitive: bool = True) -> float:
  """final_answer equal to the ground truth as a string, after collapsing whitespace."""
  got, gt = " ".join(final_answer(completion).split()), " ".join(ground_truth(example).split())
  if not case_sensitive:
    got, gt = got.casefold(), gt.casefold()
  return 1.0 if got == gt else 0.0


# -------------------------------------------------------------------------------------------- numeric
@dataclasses.dataclass(frozen=True)
class NumericOptions:
  abs_tol: float = 1e-6
  rel_tol: float = 0.0
  last_number: bool = False    # without \boxed{} or <answer>, use the completion's last number


@VERIFIERS.register("numeric", options=NumericOptions)
def numeric_verifier(example: dict, completion: str, *, abs_tol: float = 1e-6, rel_tol: float = 0.0,
                     last_number: bool = False) -> float:
  """The final answer (last \\boxed{} / <answer>) as a number within abs_tol or rel_tol of the ground truth."""
  answer = base.extract_answer(completion)
  if answer is None and last_number:
    answer = last_number_text(completion)
  gold, got = parse_number(ground_truth(example)), parse_number(answer)
  if gold is None or got is None:
    return 0.0
  return 1.0 if math.isclose(float(got), float(gold), rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


# ----------------------------------------------------------------------------------------- building
def parse_options(text: str, field: str) -> dict[str, dict[str, Any]]:
  """'numeric.abs_tol=0.01,math.timeout_seconds=10' -> {'numeric': {'abs_tol': 0.01}, 'math': {...}}; values
  are numbers, true/false, or text."""
  out: dict[str, dict[str, Any]] = {}
  for item in filter(None, (s.strip() for s in (text or "").split(","))):
    name_opt, eq, value = item.partition("=")
    name, dot, opt = name_opt.strip().partition(".")
    if not (eq and dot and name and opt):
      raise ValueError(f"{field}={text!r}: item {item!r} is not <verifier>.<option>=<value>")
    out.setdefault(name, {})[opt.strip()] = registry.parse_value(value.strip())
  return out


def by_source(verifiers_by_source: Mapping[str, Verifier], default: Verifier, example: dict,
              completion: str) -> float:
  """The reward of a row by its data_source's verifier (the default one for other sources)."""
  return float(verifiers_by_source.get(example.get("data_source"), default)(example, completion))


def preload() -> None:
  """Imports math-verify and sympy (seconds of work) so that a worker's first verification is not slowed."""
  try:
    importlib.import_module("math_verify")
  except ImportError:  # only the math verifier needs it; it fails with its own error when used
    pass


def build_verifier(spec: str, options: Mapping[str, Mapping[str, Any]] | None = None, *,
                   field: str = "verifier") -> Verifier:
  """A registered verifier by name with its options bound, or the user's 'module:function' (imported now:
  a missing module or function, or one that is not a picklable module-level function, is an error naming
  `field` and `spec`)."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"{field}={spec!r}: name a verifier ({VERIFIERS.names()}) or a 'module:function'")
  spec = spec.strip()
  if ":" in spec:
    return load_user_verifier(spec, field=field)
  if spec not in VERIFIERS:
    raise ValueError(f"{field}={spec!r}: unknown verifier; known: {VERIFIERS.names()} or a 'module:function'")
  entry = VERIFIERS.get(spec)
  try:
    opts = entry.make_options(dict((options or {}).get(spec, {})))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{field}={spec!r}: bad options: {e}") from None
  return functools.partial(entry.fn, **dataclasses.asdict(opts))


def load_user_verifier(spec: str, *, field: str = "verifier") -> Verifier:
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise ValueError(f"{field}={spec!r}: a user verifier is written 'module:function'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r} ({e}); it must be importable "
                     f"(on PYTHONPATH) in the job and its reward workers") from None
  fn = module
  for part in attr.split("."):
    fn = getattr(fn, part, None)
    if fn is None:
      raise ValueError(f"{field}={spec!r}: module {module_name!r} has no attribute {attr!r}")
  if not callable(fn):
    raise ValueError(f"{field}={spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
  try:
    inspect.signature(fn).bind({}, "")
  except TypeError:
    raise ValueError(f"{field}={spec!r}: {attr} must take (example, completion)") from None
  except ValueError:  # builtins without a signature: let the call decide
    pass
  try:
    pickle.dumps(fn)
  except Exception as e:  # noqa: BLE001 - any pickling failure means worker processes cannot get it
    raise ValueError(f"{field}={spec!r}: {attr} is not picklable ({e}); reward workers need a module-level "
                     f"function") from None
  return fn
