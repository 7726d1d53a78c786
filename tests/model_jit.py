"""The model's functions jitted, as the learner and the engine run them, for tests' references (and a reader of
the dtypes their dots multiply).

Op by op, each of a forward's hundreds of ops is a compile of its own (measured: test_model's KV-cache test 14.5 s
op by op, 2.3 s jitted). One jitted function per model function, shared by every test file, so a config two files
use is traced once per process."""
import jax

from vcpo_jax.model import transformer as M

init_params = jax.jit(M.init_params, static_argnums=0)
forward, hidden_states, decode, token_logprobs, token_logprobs_and_entropy, prompt_logprobs_and_logits = (
    jax.jit(f, static_argnums=1) for f in (M.forward, M.hidden_states, M.decode, M.token_logprobs,
                                           M.token_logprobs_and_entropy, M.prompt_logprobs_and_logits))


def dot_operand_dtypes(jaxpr) -> list:
  """The operand dtypes of every dot_general in a jaxpr, its sub-jaxprs (scan, custom VJP) included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns"):
          out += dot_operand_dtypes(sub)
  return out
