"""Tool use with a pretrained tokenizer: a tiny Qwen2 checkpoint whose Qwen2.5-style chat template has the
tools section; prompts with tools render to exactly transformers' apply_chat_template(messages, tools=...) ids,
and an episode's ids round-trip a call and a tool response through that template."""
import asyncio

import numpy as np
import pytest

from test_pretrained import qwen_style_tokenizer
from vcpo_jax import tasks
from vcpo_jax.model import tokenizer as tokenizer_lib
from vcpo_jax.rollout import episodes, types
from vcpo_jax.tasks.environments import calculator

transformers = pytest.importorskip("transformers")

# Qwen2.5's documented conversation format: tools as JSON schemas in the system turn, calls as
# <tool_call>{"name", "arguments"}</tool_call> in the assistant's turn, consecutive tool messages as
# <tool_response> blocks in one user turn.
TOOLS_HEADER = ("\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
                "provided with function signatures within <tools></tools> XML tags:\\n<tools>")
TOOLS_FOOTER = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n")
CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful "
    "assistant.' %}\n"
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' + system + '" + TOOLS_HEADER + "' }}\n"
    "{%- for tool in tools %}\n{{- '\\n' }}{{- tool | tojson }}\n{%- endfor %}\n"
    "{{- '" + TOOLS_FOOTER + "' }}\n"
    "{%- else %}\n{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "  {%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant' }}\n"
    "    {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}\n"
    "    {%- for call in message.tool_calls %}\n"
    "      {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- call.name }}{{- '\", \"arguments\": ' }}{{- call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}\n"
    "    {%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "  {%- elif message.role == 'tool' %}\n"
    "    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
CORPUS = ["Using the numbers [3, 5], make an equation that equals 8. Put the final answer in <answer></answer>.",
          '{"name": "calculator", "arguments": {"expression": "3+5"}} <tool_response>\n8\n</tool_response>',
          "# Tools You may call one or more functions <tools></tools> function signatures", "0123456789 +-*/()"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """Tokenizer files only (the template and ids are what is checked): byte-level BPE with Qwen's added
  tokens, <tool_call> and </tool_call> as non-special added tokens as in Qwen2.5."""
  out = str(tmp_path_factory.mktemp("qwen_tools"))
  fast = qwen_style_tokenizer(CORPUS, CHAT_TEMPLATE, added_tokens=["<tool_call>", "</tool_call>"])
  fast.save_pretrained(out)
  return out


def _ids(x):
  return list(x["input_ids"] if hasattr(x, "keys") else x)


def test_prompts_with_tools_render_to_transformers_ids(ckpt):
  ours, theirs = tokenizer_lib.load_pretrained(ckpt), transformers.AutoTokenizer.from_pretrained(ckpt)
  tools = calculator.environment_of().declarations()
  task = tasks.get_task("countdown_tools", num_numbers=3, max_number=10, max_target=100,
                        render_prompt=ours.chat_prompt)
  for ex in task.sample(0, 5):
    messages = [{"role": "user", "content": task.user_text(ex["numbers"], ex["target"])}]
    want = _ids(theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True))
    assert ours.encode(ex["prompt"]) == want
    assert ex["prompt"] == theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
    assert '"name": "calculator"' in ex["prompt"] and "# Tools" in ex["prompt"]  # the schema was declared
  # Without tools the template's plain branch: the single-turn tasks' prompts are unchanged.
  plain = [{"role": "user", "content": "Compute 2 + 2."}]
  assert ours.chat_prompt("Compute 2 + 2.") == theirs.apply_chat_template(plain, add_generation_prompt=True,
                                                                          tokenize=False)


class ScriptedPolicy:
  def __init__(self, turns):
    self.turns, self.inputs = turns, []

  async def __call__(self, input_ids, params, n=1):
    ids = self.turns[len(self.inputs)]
    self.inputs.append(list(input_ids))
    return [types.Sample(list(input_ids), ids, np.full(len(ids), -0.5, np.float32), np.zeros(len(ids), np.int64),
                         "stop", "scripted")]


@pytest.mark.parametrize("expression,content", [("2*3", "6"), ("2/0", "error: division by zero")])
def test_an_episode_round_trips_a_call_and_a_tool_response(ckpt, expression, content):
  ours, theirs = tokenizer_lib.load_pretrained(ckpt), transformers.AutoTokenizer.from_pretrained(ckpt)
  task = tasks.get_task("countdown_tools", num_numbers=2, max_number=6, max_target=40,
                        render_prompt=ours.chat_prompt)
  env = task.environment()
  ex = task.sample(1, 1)[0]
  call, answer = calculator.call(expression), "<answer>2*3</answer>"
  policy = ScriptedPolicy([ours.encode(call), ours.encode(answer) + [ours.eos_id]])
  runner = episodes.runner_for(task, ours, max_new_tokens=400)
  prompt = ours.encode(ex["prompt"])
  (sample,) = asyncio.run(runner.generate(policy, prompt, {"max_new_tokens": 400}))
  assert (sample.num_turns, sample.tool_calls, sample.tool_errors) == (2, 1, int(content.startswith("error")))
  messages = [{"role": "user", "content": task.user_text(ex["numbers"], ex["target"])},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
              {"role": "tool", "name": "calculator", "content": content},
              {"role": "assistant", "content": answer}]
  want = _ids(theirs.apply_chat_template(messages, tools=env.declarations(), tokenize=True))
  # The whole episode (prompt, call, tool turn, answer up to its <|im_end|>) is transformers' conversation.
  assert prompt + sample.output_ids == want[:len(prompt) + len(sample.output_ids)]
  assert theirs.decode(want[len(prompt) + len(sample.output_ids):]) == "\n"
  # The second turn was generated on exactly transformers' rendering up to the next assistant turn.
  upto = _ids(theirs.apply_chat_template(messages[:3], tools=env.declarations(), add_generation_prompt=True,
                                         tokenize=True))
  assert policy.inputs[1] == upto
  mask = np.asarray(sample.output_mask)
  assert ours.decode(np.asarray(sample.output_ids)[mask == 0]) == ours.chat_prompt.tool_reply(content)
