"""A Hugging Face tokenizer directory's special tokens, stop ids and chat template (rendered with Jinja)."""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import shutil
from typing import Any, Mapping, Sequence

# Everything a tokenizer directory may hold; exported unchanged next to the weights (for SGLang/transformers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json")
END_OF_TURN = "<|im_end|>"  # Qwen's end of an assistant turn (ChatML)


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
  chat_template: str | None
  template_vars: dict
  pad_id: int
  eos_id: int                      # where a chat reply ends: the SFT target's last token
  stop_ids: tuple[int, ...]        # every id that ends generation
  special_ids: frozenset[int]
  bos_id: int | None


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _token_text(value) -> str | None:
  """tokenizer_config stores a special token as a string or as an AddedToken dict with 'content'."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _chat_template(model_dir: str, config: Mapping[str, Any]) -> str | None:
  """chat_template.jinja (newer transformers) or tokenizer_config.json's chat_template (a string, or a list
  of named templates of which 'default' is used)."""
  path = os.path.join(model_dir, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path) as f:
      return f.read()
  template = config.get("chat_template") or _read_json(os.path.join(model_dir, "chat_template.json")).get(
      "chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default")
  return template


def read_info(model_dir: str, vocab: Mapping[str, int]) -> TokenizerInfo:
  config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
  names = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
  ids = {k: vocab.get(v) for k, v in names.items() if v is not None}
  eos_id = vocab.get(END_OF_TURN, ids.get("eos_token"))
  if eos_id is None:
    raise ValueError(f"tokenizer in {model_dir!r} has neither {END_OF_TURN!r} nor an eos_token in its vocab")
  generation = _read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id")
  generation = [generation] if isinstance(generation, int) else list(generation or [])
  stop_ids = tuple(dict.fromkeys(i for i in [eos_id, ids.get("eos_token"), *generation] if i is not None))
  added = config.get("added_tokens_decoder") or {}
  special = {int(i) for i, t in added.items() if isinstance(t, dict) and t.get("special")}
  with open(os.path.join(model_dir, "tokenizer.json")) as f:
    special |= {int(t["id"]) for t in json.load(f).get("added_tokens", []) if t.get("special")}
  extra = [_token_text(t) for t in config.get("additional_special_tokens") or []]
  template_vars = {k: v or "" for k, v in names.items()}
  template_vars["additional_special_tokens"] = [t for t in extra if t]
  pad_id = ids.get("pad_token", ids.get("eos_token", eos_id))
  return TokenizerInfo(_chat_template(model_dir, config), template_vars, pad_id, eos_id, stop_ids,
                       frozenset(special), ids.get("bos_token"))


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]], template_vars: Mapping, *,
                tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
  """The chat template applied as transformers applies it (sandboxed Jinja, trim_blocks, lstrip_blocks), with
  the tools' JSON schemas declared to it (tools=None: none), by default ending with the generation prompt."""
  return compile_template(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                           tools=list(tools) if tools else None, documents=None, **template_vars)


@functools.lru_cache(maxsize=16)
def compile_template(template: str | None):
  """The compiled Jinja template (cached: prompts and tool replies render it once per example or call)."""
  if not template:
    raise ValueError("the pretrained tokenizer has no chat template (tokenizer_config.json chat_template or "
                     "chat_template.jinja); the tasks' prompts need one")
  try:
    import jinja2.ext  # noqa: PLC0415
    import jinja2.sandbox  # noqa: PLC0415
  except ImportError as e:  # pragma: no cover - jinja2 is in requirements.txt
    raise ImportError("rendering a chat template needs jinja2 (pip install -r requirements.txt)") from e

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def copy_files(src_dir: str, out_dir: str) -> None:
  for name in TOKENIZER_FILES:
    src = os.path.join(src_dir, name)
    if os.path.isfile(src):
      shutil.copy2(src, os.path.join(out_dir, name))
