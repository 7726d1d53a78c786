"""A chat template's prompts (with declared tools) and tool replies, rendered as transformers renders them."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from vcpo_jax.model import pretrained_tokenizer as pretrained

CALL_CLOSE = "</tool_call>"  # where an assistant's tool call ends in Qwen2.5/Qwen3-style templates
# Stand-ins for a tool reply's content and a call, used once to cut the template's rendering of a tool turn.
_CONTENT = "\x00tool-response-content\x00"
_PROBE_CALL = {"type": "function", "function": {"name": "probe", "arguments": {}}}


class ChatFormat:
  """A template's conversation format: `fmt(user_text, tools=[schema, ...])` is the prompt the assistant
  continues; `fmt.tool_reply(content)` is what follows an assistant's call (`...</tool_call>`) up to where the
  assistant's next turn starts: the end of the call's turn, the tool message as the template renders it, and
  the generation prompt. Tokens of that text are the environment's (mask 0), the model writes the rest."""

  def __init__(self, template: Optional[str], template_vars: Optional[Mapping[str, Any]] = None):
    self.template, self.template_vars = template, dict(template_vars or {})
    self._reply_parts: Optional[tuple[str, str]] = None

  def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Optional[Sequence[Mapping]] = None,
             add_generation_prompt: bool = True) -> str:
    return pretrained.render_chat(self.template, messages, self.template_vars, tools=tools,
                                  add_generation_prompt=add_generation_prompt)

  def __call__(self, user_text: str, tools: Optional[Sequence[Mapping]] = None) -> str:
    return self.render([{"role": "user", "content": user_text}], tools=tools)

  def tool_reply(self, content: str) -> str:
    """The text after a call's `</tool_call>` through the next generation prompt, `content` in its place."""
    if not isinstance(content, str):
      raise ValueError(f"tool reply content must be a str, got {type(content).__name__}")
    if self._reply_parts is None:
      self._reply_parts = self._cut_tool_turn()
    before, after = self._reply_parts
    return before + content + after

  def _cut_tool_turn(self) -> tuple[str, str]:
    messages = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
                {"role": "tool", "name": "probe", "content": _CONTENT}]
    text = self.render(messages, add_generation_prompt=True)
    call_end = text.rfind(CALL_CLOSE)
    if call_end < 0 or text.count(_CONTENT) != 1 or text.find(_CONTENT) < call_end:
      raise ValueError(f"the chat template does not render an assistant's tool_calls as <tool_call>...{CALL_CLOSE} "
                       f"followed by a tool message (Qwen2.5/Qwen3 style); rendered a tool turn as {text!r}")
    reply = text[call_end + len(CALL_CLOSE):]
    before, after = reply.split(_CONTENT)
    return before, after
