"""GRPO on a model that is not ours: the engine only needs a function from tokens to logits.

  python examples/plain_jax_model.py   # CPU, ~10 s; shards over fsdp=4 when 4 devices exist

The embeddable API, in order:
  fns = PolicyFns(apply=apply_fn)  # apply_fn(params, tokens_RS, positions_RS, segment_ids_RS) -> logits_RSV
  cfg = TrainConfig(loss=LossConfig(group_size=4, advantage="grpo"), optim=OptimConfig(lr=...))
  tx = make_optimizer(cfg.optim, cfg.loss.updates)
  state = create_train_state(params, cfg, tx)  # params: any pytree, placed/sharded as you like (donated)
  step = make_train_step(fns, cfg, tx, state, mesh=mesh, rules=TRAIN_RULES)  # one jit; state donated
  state, metrics = step(state, build_batch(completions, n_micro=, rows=, row_len=, resp_len=))
Packed rows hold several sequences, so apply_fn must keep attention inside a segment (segment_ids,
0 = padding) and read positions, which restart at 0 for each sequence.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_topo.topology.rules import TRAIN_RULES, make_mesh
from jaxrl_topo.train.batch import Completion, build_batch
from jaxrl_topo.train.config import LossConfig, OptimConfig, TrainConfig
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.policy import PolicyFns, sequence_logprobs
from jaxrl_topo.train.state import create_train_state
from jaxrl_topo.train.step import make_train_step

# R rows, S row length (queries), K row length (keys), D width, V vocab.
V, D, MAX_LEN = 32, 32, 64
GROUP, PROMPTS, PROMPT_LEN, RESP_LEN = 4, 8, 4, 8
# FSDP-style: every weight's D dim split over the mesh's `fsdp` axis.
SPECS = {"embed": P(None, "fsdp"), "pos": P(None, "fsdp"), "wq": P("fsdp"), "wk": P("fsdp"), "wv": P("fsdp"),
         "out": P("fsdp")}


def init_params(key):
  """One single-head attention layer with a residual, learned positions, untied output."""
  scale = {"embed": 1.0, "pos": 0.1, "wq": D**-0.5, "wk": D**-0.5, "wv": D**-0.5, "out": 0.1 * D**-0.5}
  shape = {"embed": (V, D), "pos": (MAX_LEN, D), "out": (D, V)}
  keys = dict(zip(scale, jax.random.split(key, len(scale)), strict=True))
  return {n: s * jax.random.normal(keys[n], shape.get(n, (D, D)), jnp.float32) for n, s in scale.items()}


def apply_fn(params, tokens_RS, positions_RS, segment_ids_RS):
  """Causal attention within each packed segment -> logits [R, S, V]."""
  x_RSD = params["embed"][tokens_RS] + params["pos"][positions_RS]
  q_RSD, k_RKD, v_RKD = (x_RSD @ params[n] for n in ("wq", "wk", "wv"))
  S = tokens_RS.shape[1]
  same_RSK = segment_ids_RS[:, :, None] == segment_ids_RS[:, None, :]
  mask_RSK = same_RSK & jnp.tril(jnp.ones((S, S), bool))[None]
  scores_RSK = jnp.einsum("RSD,RKD->RSK", q_RSD, k_RKD) * D**-0.5
  attn_RSK = jax.nn.softmax(jnp.where(mask_RSK, scores_RSK, -1e30), axis=-1)
  h_RSD = x_RSD + jnp.einsum("RSK,RKD->RSD", attn_RSK, v_RKD)
  return h_RSD @ params["out"]


def reward(response) -> float:
  """The rule to learn: 1 if most response tokens come from the lower half of the vocabulary."""
  return float(np.mean(np.asarray(response) < V // 2) > 0.5)


@jax.jit
def response_logprobs(params, batch):
  """[M, B, T] log-probs of the response tokens under `params`, gathered as the train step does."""
  def one(tokens, positions, segments, gather, targets):
    return sequence_logprobs(PolicyFns(apply=apply_fn), params, (tokens, positions, segments), gather, targets,
                             temperature=1.0, chunk=1)[0]
  return jax.vmap(one)(batch.tokens_MRS, batch.positions_MRS, batch.segment_ids_MRS, batch.gather_MBT,
                       batch.targets_MBT)


def make_batch(params, seed: int = 0):
  """Random completions in groups of GROUP per prompt; sampler log-probs are the initial policy's."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, V, (PROMPTS, PROMPT_LEN)).repeat(GROUP, axis=0)
  responses = rng.integers(0, V, (PROMPTS * GROUP, RESP_LEN))
  completions = [Completion(prompt=list(p), response=list(r), reward=reward(r), sampler_logp=[0.0] * RESP_LEN)
                 for p, r in zip(prompts, responses, strict=True)]
  # Two microbatches of 16 sequences, packed two per row (12 tokens each into rows of 24).
  batch = build_batch(completions, n_micro=2, rows=8, row_len=24, resp_len=RESP_LEN, pack=True)
  return batch.replace(sampler_logp_MBT=np.asarray(response_logprobs(params, batch)))


def logp_gap(params, batch) -> float:
  """Mean token log-prob of rewarded responses minus that of unrewarded ones."""
  mask = batch.mask_MBT
  seq_logp = np.asarray((response_logprobs(params, batch) * mask).sum(-1)) / mask.sum(-1)
  won = batch.rewards_MB > 0
  return float(seq_logp[won].mean() - seq_logp[~won].mean())


def setup(n_devices: int = 4, lr: float = 3e-3, seed: int = 0):
  """(state, step, batch, mesh, initial params' gap): params sharded over fsdp=n_devices."""
  mesh = make_mesh({"fsdp": n_devices}, jax.devices()[:n_devices])
  params = init_params(jax.random.key(seed))
  params = {n: jax.device_put(x, NamedSharding(mesh, SPECS[n])) for n, x in params.items()}
  batch = make_batch(params, seed)
  gap0 = logp_gap(params, batch)  # before create_train_state: it donates `params`
  cfg = TrainConfig(loss=LossConfig(group_size=GROUP, advantage="grpo"), optim=OptimConfig(lr=lr), seed=seed)
  tx = make_optimizer(cfg.optim, cfg.loss.updates)
  state = create_train_state(params, cfg, tx)
  step = make_train_step(PolicyFns(apply=apply_fn), cfg, tx, state, mesh=mesh, rules=TRAIN_RULES)
  return state, step, batch, gap0


def train(state, step, batch, n_steps: int, log_every: int = 0):
  for i in range(n_steps):
    state, metrics = step(state, batch)  # the old `state` is donated: never touch it again
    if log_every and (i + 1) % log_every == 0:
      print(f"step {i + 1:3d}  loss {float(metrics['loss']):+.4f}  reward {float(metrics['reward/mean']):.3f}  "
            f"logp gap (rewarded - unrewarded) {logp_gap(state.params['policy'], batch):+.3f}")
  return state


def main():
  n = 4 if len(jax.devices()) >= 4 else 1
  state, step, batch, gap0 = setup(n_devices=n)
  print(f"{len(jax.devices())} devices, fsdp={n}; logp gap before training {gap0:+.3f}")
  train(state, step, batch, n_steps=20, log_every=2)


if __name__ == "__main__":
  main()
