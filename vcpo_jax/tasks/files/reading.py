"""Reading a dataset task's files (JSONL, parquet) into plain records; every bad row is an error naming the
file, the row and the field."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Iterable, Mapping, Sequence

SCHEMAS = ("auto", "verl", "plain")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclasses.dataclass(frozen=True)
class Keys:
  """Column names of plain rows (verl rows have fixed names)."""
  question: str = "question"
  answer: str = "answer"
  solution: str = "solution"


@dataclasses.dataclass(frozen=True)
class Record:
  """One problem as read: its chat messages (before any template), ground truth and bookkeeping."""
  messages: tuple          # ({"role": ..., "content": ...}, ...)
  ground_truth: str
  data_source: str
  extra_info: dict
  solution: str | None
  where: str               # "<file>: row <n>" for error messages (not part of the example)


def split_paths(files: str | Sequence[str], field: str) -> list[str]:
  """'a.jsonl,b.parquet' or a list -> paths; none at all is an error naming `field`."""
  items = files.split(",") if isinstance(files, str) else list(files or ())
  paths = [os.path.expanduser(str(p).strip()) for p in items if str(p).strip()]
  if not paths:
    raise ValueError(f"{field}={files!r}: give one or more files (comma-separated), JSONL or parquet")
  return paths


def read_records(paths: Iterable[str], *, schema: str, keys: Keys, system_prompt: str, instruction: str,
                 field: str) -> list[Record]:
  """Every row of every file, in order, as a Record."""
  if schema not in SCHEMAS:
    raise ValueError(f"schema={schema!r}: must be one of {SCHEMAS}")
  out = []
  for path in paths:
    rows = read_rows(path, field)
    file_schema = schema if schema != "auto" else ("verl" if "reward_model" in rows[0][1] else "plain")
    stem = os.path.splitext(os.path.basename(path))[0]
    if file_schema == "plain":
      for column in (keys.question, keys.answer):
        if column not in rows[0][1]:
          raise ValueError(f"{path}: row {rows[0][0]}: no column {column!r} (the configured key); columns: "
                           f"{sorted(rows[0][1])}")
    for n, row in rows:
      where = f"{path}: row {n}"
      if file_schema == "verl":
        out.append(_verl_record(row, where, stem, keys.solution))
      else:
        out.append(_plain_record(row, where, stem, keys, system_prompt, instruction))
  return out


def _verl_record(row: Mapping[str, Any], where: str, stem: str, solution_key: str) -> Record:
  """verl's schema: prompt (chat messages), reward_model.ground_truth, data_source, extra_info; a solution in
  an extra column (verl ignores it) serves the warm start."""
  reward_model = row.get("reward_model")
  if not isinstance(reward_model, Mapping):
    raise ValueError(f"{where}: field 'reward_model' must be a mapping with 'ground_truth', got "
                     f"{_short(reward_model)}")
  return Record(messages=_messages(row.get("prompt"), where, "prompt"),
                ground_truth=_ground_truth(reward_model.get("ground_truth"), where, "reward_model.ground_truth"),
                data_source=_source(row.get("data_source"), where, stem),
                extra_info=_extra(row.get("extra_info"), where),
                solution=_solution(row.get(solution_key), where, solution_key), where=where)


def _plain_record(row: Mapping[str, Any], where: str, stem: str, keys: Keys, system_prompt: str,
                  instruction: str) -> Record:
  question = row.get(keys.question)
  if isinstance(question, str):
    if not question.strip():
      raise ValueError(f"{where}: field {keys.question!r} is empty")
    text = f"{question} {instruction}" if instruction else question
    system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
    messages = system + ({"role": "user", "content": text},)
  else:
    messages = _messages(question, where, keys.question)
  used = {keys.question, keys.answer, keys.solution, "data_source", "extra_info"}
  extra = {**{k: v for k, v in row.items() if k not in used}, **_extra(row.get("extra_info"), where)}
  return Record(messages=messages, ground_truth=_ground_truth(row.get(keys.answer), where, keys.answer),
                data_source=_source(row.get("data_source"), where, stem), extra_info=extra,
                solution=_solution(row.get(keys.solution), where, keys.solution), where=where)


def _messages(value: Any, where: str, field: str) -> tuple:
  if isinstance(value, str) and value.strip():
    return ({"role": "user", "content": value},)
  ok = isinstance(value, (list, tuple)) and value and all(
      isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
      for m in value)
  if not ok:
    raise ValueError(f"{where}: field {field!r} must be text or a list of chat messages "
                     f"[{{'role': ..., 'content': ...}}, ...], got {_short(value)}")
  return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _solution(value: Any, where: str, field: str) -> str | None:
  if value is not None and not isinstance(value, str):
    raise ValueError(f"{where}: field {field!r} (the warm-start solution) must be text, got {_short(value)}")
  return value or None


def _ground_truth(value: Any, where: str, field: str) -> str:
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  if not isinstance(value, str) or not value.strip():
    raise ValueError(f"{where}: field {field!r} (the ground truth) is missing or not text/a number: "
                     f"{_short(value)}")
  return value


def _source(value: Any, where: str, default: str) -> str:
  if value is None:
    return default
  if not isinstance(value, str) or not value:
    raise ValueError(f"{where}: field 'data_source' must be non-empty text, got {_short(value)}")
  return value


def _extra(value: Any, where: str) -> dict:
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise ValueError(f"{where}: field 'extra_info' must be a mapping, got {_short(value)}")
  return dict(value)


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------------------ file reading
def read_rows(path: str, field: str = "files") -> list[tuple[int, dict]]:
  """(row number from 1, row dict) of a JSONL or parquet file; cached while the file is unchanged."""
  if not os.path.isfile(path):
    raise ValueError(f"{field}: dataset file {path!r} does not exist")
  stat = os.stat(path)
  rows = _read_rows_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
  if not rows:
    raise ValueError(f"{field}: dataset file {path!r} has no rows")
  return rows


@functools.lru_cache(maxsize=16)
def _read_rows_cached(path: str, mtime_ns: int, size: int) -> list[tuple[int, dict]]:
  del mtime_ns, size  # the cache key: a rewritten file is read again
  lower = path.lower()
  if lower.endswith(JSONL_SUFFIXES):
    return _read_jsonl(path)
  if lower.endswith(PARQUET_SUFFIXES):
    return _read_parquet(path)
  raise ValueError(f"dataset file {path!r}: unknown format; names must end in {JSONL_SUFFIXES + PARQUET_SUFFIXES}")


def _read_jsonl(path: str) -> list[tuple[int, dict]]:
  """One JSON object per line (blank lines skipped); row numbers are line numbers."""
  out = []
  with open(path, "rb") as f:
    for n, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}: row {n}: line is not UTF-8 (byte {raw[e.start]:#04x} at column "
                         f"{e.start + 1})") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: row {n}: not JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}: row {n}: a row must be a JSON object, got {_short(row)}")
      out.append((n, row))
  return out


def _read_parquet(path: str) -> list[tuple[int, dict]]:
  import pyarrow.parquet as pq  # noqa: PLC0415 - only file-backed tasks need pyarrow
  try:
    table = pq.read_table(path)
  except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
    raise ValueError(f"{path}: cannot read as parquet: {e}") from None
  return [(n, row) for n, row in enumerate(table.to_pylist(), start=1)]
