"""Reading an optimized HLO module's text: custom calls (with operand shapes) and its largest arrays."""
from __future__ import annotations

import collections
import re

import numpy as np

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?)\}(?:,\s*\w+=|$)")
# Results that alias a buffer made elsewhere (no memory of their own; a loop's state is its body's buffers).
_ALIASING = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "copy-done", "opt-barrier", "while",
             "call"}
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
          "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def _split_type(rhs: str) -> tuple[str, str, str]:
  """(result type, op name, the rest) of an instruction's right-hand side."""
  if rhs.startswith("("):
    depth = 0
    for i, ch in enumerate(rhs):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        break
    type_str, rest = rhs[:i + 1], rhs[i + 1:].lstrip()
  else:
    type_str, _, rest = rhs.partition(" ")
  op, _, args = rest.partition("(")
  return type_str, op.strip(), args


def instructions(text: str):
  """(computation, name, result type, op, operands and attributes) of every instruction."""
  computation = ""
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):  # headers start a line; instructions are indented
      computation = m.group(2)
      continue
    m = _INSTRUCTION.match(line)
    if m:
      type_str, op, rest = _split_type(m.group(2))
      yield computation, m.group(1), type_str, op, rest


def arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_str)]


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
  return int(np.prod(dims, dtype=np.int64) * _BYTES[dtype])


def shape_str(dtype: str, dims: tuple[int, ...]) -> str:
  return f"{dtype}[{','.join(map(str, dims))}]"


def custom_calls(text: str) -> dict:
  """{target: {"count": n, "operands": [...], "results": [...]}}: the distinct operand and result shape lists of
  each custom-call target (operands from its layout constraints, else looked up by name), in program order."""
  insts = list(instructions(text))
  types = {name: type_str for _, name, type_str, _, _ in insts}
  out = {}
  for _, _, type_str, op, rest in insts:
    if op != "custom-call":
      continue
    m = _TARGET.search(rest)
    entry = out.setdefault(m.group(1) if m else "?", {"count": 0, "operands": [], "results": []})
    entry["count"] += 1
    constraints = _CONSTRAINTS.search(rest)
    if constraints:
      shapes = arrays(constraints.group(1))
    else:
      names = re.findall(r"%?([\w.\-]+)", rest.split(")", 1)[0])
      shapes = [a for n in names for a in arrays(types.get(n, ""))]
    for key, found in (("operands", shapes), ("results", arrays(type_str))):
      listed = " ".join(shape_str(d, s) for d, s in found)
      if listed not in entry[key]:
        entry[key].append(listed)
  return out


def largest_arrays(text: str, top: int = 10) -> list[dict]:
  """The `top` largest array shapes made outside fusion bodies (a fusion's insides are not buffers), each with
  its bytes, how many instructions make one and which ops; results that only alias another buffer left out."""
  found = collections.defaultdict(lambda: {"count": 0, "ops": collections.Counter()})
  for computation, _, type_str, op, _ in instructions(text):
    if op in _ALIASING or "fused" in computation or computation.startswith("wrapped"):
      continue
    for dtype, dims in arrays(type_str):
      entry = found[(dtype, dims)]
      entry["count"] += 1
      entry["ops"][op] += 1
  ranked = sorted(found.items(), key=lambda kv: -nbytes(*kv[0]))[:top]
  return [{"shape": shape_str(d, s), "bytes": nbytes(d, s), "count": e["count"],
           "ops": dict(e["ops"].most_common(3))} for (d, s), e in ranked]


def f32_vocab_arrays(text: str, vocab: int, params: set) -> list[str]:
  """Float32 arrays with a vocab-sized dim ([tokens, vocab] logits, their gradient, vocab chunks' stacks) made
  outside fusion bodies, leaving out the shapes in `params` (the per-device parameter shapes: their gradients,
  moments and transposes have them too)."""
  out = []
  for computation, _, type_str, op, _ in instructions(text):
    if op in _ALIASING or "fused" in computation:
      continue
    for dtype, dims in arrays(type_str):
      s = shape_str(dtype, dims)
      if dtype == "f32" and vocab in dims and dims not in params and dims[::-1] not in params and s not in out:
        out.append(s)
  return out


def attention_bias(calls: dict) -> list[str]:
  """The [B, 1, T, S] bias arrays cuDNN's bias variants take (forward) and write (the backward's bias gradient)."""
  out = []
  for target, entry in calls.items():
    if "Bias" not in target:
      continue
    key = "results" if "Backward" in target else "operands"
    shapes = {s for listed in entry[key] for s in listed.split() if re.fullmatch(r"\w+\[\d+,1,\d+,\d+\]", s)}
    out += [f"{s} ({'written by the backward' if key == 'results' else 'read'})" for s in sorted(shapes)]
  return sorted(out)


def attention_kernel(calls: dict) -> str:
  """The attention kernel the program runs, read from its custom calls."""
  fmha = sorted(t for t in calls if "fmha" in t and "Backward" not in t)
  if fmha:
    return "cuDNN " + ", ".join(t.removeprefix("__cudnn$") for t in fmha)
  if "tpu_custom_call" in calls:
    return "Pallas (Mosaic) kernel"
  return "XLA (no attention kernel)"
