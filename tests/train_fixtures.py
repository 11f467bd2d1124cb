"""Shared set-up for the train-step tests: two policies, ragged completions, a gradient-capturing optimizer.

Policies, by name:
  "tiny"  the `tiny` preset transformer (init_params on the requested mesh);
  "toy"   a 3-matrix model that compiles several times faster, for wide parametrised sweeps:
          hidden = tanh(Σ embeddings of the causal prefix within the token's own segment · W).
          It is packing-aware (segment ids) but has no attention; invariances that involve the
          model's own packing/sharding are tested on "tiny".
`grad_capture()` is an optax transformation whose update is -grad (SGD, lr 1) and whose state after
a step IS the gradient, so tests compare gradients directly, without Adam's normalisation hiding a
wrong scale. Steps are make_train_step's jitted function compiled ahead of time (LLVM -O0, see
FAST_COMPILE) and cached per (config, policy, mesh, optimizer, batch shapes), so a test that reuses a
configuration pays no second compilation; test_step_compiles_once covers the plain jit call path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_topo.models.model import init_params
from jaxrl_topo.models.presets import PRESETS
from jaxrl_topo.topology.rules import TRAIN_RULES, make_mesh
from jaxrl_topo.train.batch import Completion, TrainBatch, build_batch
from jaxrl_topo.train.config import TrainConfig
from jaxrl_topo.train.policy import PolicyFns, model_fns, sequence_logprobs
from jaxrl_topo.train.state import create_train_state
from jaxrl_topo.train.step import make_train_step, train_step

TINY = PRESETS["tiny"]
TOY_VOCAB, TOY_D = 32, 8


def grad_capture() -> optax.GradientTransformation:
  """update = -grad (SGD, lr 1); the new optimizer state is the gradient itself."""
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (jax.tree.map(jnp.negative, grads), grads))


GRAD_TX = grad_capture()  # one object, so cached steps keyed on it hit


def _toy_hidden(params, tokens_RS, positions_RS, segment_ids_RS):
  S = tokens_RS.shape[1]
  causal_1SS = (jnp.arange(S)[:, None] >= jnp.arange(S)[None, :])[None]
  same_RSS = (segment_ids_RS[:, :, None] == segment_ids_RS[:, None, :]) & causal_1SS
  e_RSD = jnp.take(params["embed"], tokens_RS, axis=0)
  return jnp.tanh(jnp.einsum("RST,RTD,DE->RSE", same_RSS.astype(jnp.float32), e_RSD, params["w"]))


def _toy_unembed(params):
  return params["out"]


TOY_FNS = PolicyFns(hidden=_toy_hidden, unembed=_toy_unembed)


@functools.cache
def _tiny_base(mesh_axes: tuple | None):
  mesh = make_mesh(dict(mesh_axes)) if mesh_axes is not None else None
  graphdef, params = init_params(TINY, jax.random.key(0), mesh, TRAIN_RULES if mesh is not None else None)
  return mesh, model_fns(graphdef), params


def policy(name: str, mesh_axes: tuple | None = None):
  """(mesh, fns, params, d_model, vocab) with a FRESH params copy: create_train_state donates its input."""
  if name == "toy":
    assert mesh_axes is None, "the toy policy has no sharding annotations"
    k = jax.random.split(jax.random.key(0), 3)
    params = {"embed": jax.random.normal(k[0], (TOY_VOCAB, TOY_D)),
              "w": jax.random.normal(k[1], (TOY_D, TOY_D)) / 3, "out": jax.random.normal(k[2], (TOY_D, TOY_VOCAB))}
    return None, TOY_FNS, params, TOY_D, TOY_VOCAB
  mesh, fns, params = _tiny_base(mesh_axes)
  return mesh, fns, jax.tree.map(jnp.copy, params), TINY.d_model, TINY.vocab_size


def ragged_completions(n: int, vocab: int, *, seed: int = 0, max_prompt: int = 5, max_resp: int = 6
                       ) -> list[Completion]:
  """n completions with random prompt/response lengths and tokens, rewards ~ N(0, 1); sampler_logp zeros."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    prompt = rng.randint(1, vocab, rng.randint(1, max_prompt + 1)).tolist()
    response = rng.randint(1, vocab, rng.randint(1, max_resp + 1)).tolist()
    out.append(Completion(prompt, response, float(rng.randn()), [0.0] * len(response)))
  return out


@functools.partial(jax.jit, static_argnums=0)
def _micro_logprobs(fns, params, tokens_RS, positions_RS, segment_ids_RS, gather_BT, targets_BT):
  rows = (tokens_RS, positions_RS, segment_ids_RS)
  return sequence_logprobs(fns, params, rows, gather_BT, targets_BT, temperature=1.0, chunk=1024)[0]


def batch_logprobs(fns: PolicyFns, params, batch: TrainBatch) -> np.ndarray:
  """log π(response token) [M, B, T] via the library's `sequence_logprobs`, one jitted call per microbatch."""
  return np.stack([np.asarray(_micro_logprobs(
      fns, params, batch.tokens_MRS[m], batch.positions_MRS[m], batch.segment_ids_MRS[m], batch.gather_MBT[m],
      batch.targets_MBT[m])) for m in range(batch.n_micro)])


def completion_logprobs(fns: PolicyFns, params, completions) -> list[np.ndarray]:
  """Per completion, the policy's log-prob of each response token (one padded microbatch)."""
  row_len = max(len(c.prompt) + len(c.response) for c in completions)
  resp_len = max(len(c.response) for c in completions)
  batch = build_batch(completions, n_micro=1, rows=len(completions), row_len=row_len, resp_len=resp_len, pack=False)
  logp_BT = batch_logprobs(fns, params, batch)[0]
  return [logp_BT[i, : len(c.response)] for i, c in enumerate(completions)]


def perturbed(logps, noise: float, seed: int) -> list[list[float]]:
  rng = np.random.RandomState(seed)
  return [(lp + noise * rng.randn(len(lp))).tolist() for lp in logps]


# LLVM at -O0: the same XLA program (same fusions, same float semantics), ~40% less compile time on CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.cache
def _executable(cfg: TrainConfig, name: str, mesh_axes: tuple | None, tx, batch_avals: tuple):
  """make_train_step's jitted step, lowered and compiled ahead of time for one batch signature."""
  mesh, fns, params, d_model, _ = policy(name, mesh_axes)
  state = create_train_state(params, cfg, tx, d_model=d_model)
  step = make_train_step(fns, cfg, tx, state, mesh=mesh, rules=TRAIN_RULES)
  struct, leaves = batch_avals
  batch = jax.tree.unflatten(struct, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaves])
  return step.lower(state, batch).compile(compiler_options=FAST_COMPILE)


def fresh_state(cfg: TrainConfig, name: str = "tiny", mesh_axes: tuple | None = None, tx=GRAD_TX):
  """A new state (fresh params) and `step(state, batch)`: the compiled step (cached per batch shapes)."""
  _, _, params, d_model, _ = policy(name, mesh_axes)

  def step(state, batch):
    leaves, struct = jax.tree.flatten(batch)
    avals = (struct, tuple((np.shape(x), np.asarray(x).dtype) for x in leaves))
    return _executable(cfg, name, mesh_axes, tx, avals)(state, batch)

  return create_train_state(params, cfg, tx, d_model=d_model), step


def one_step(cfg: TrainConfig, batch: TrainBatch, name: str = "tiny", mesh_axes: tuple | None = None, tx=GRAD_TX):
  """(trainable params before, state after, metrics) of one step from a fresh state, all on the host.

  The tiny model runs the jitted step of `make_train_step`; the toy runs `train_step` op by op under
  `jax.disable_jit()` (STYLE H12's no-jit variant): its per-primitive executables are cached across
  configurations, so a wide sweep costs a fraction of one compilation per configuration.
  """
  if name == "toy":
    _, fns, params, d_model, _ = policy(name)
    state = create_train_state(params, cfg, tx, d_model=d_model)
    before = jax.device_get(state.params)
    with jax.disable_jit():
      new_state, metrics = train_step(state, batch, fns=fns, cfg=cfg, tx=tx)
  else:
    state, step = fresh_state(cfg, name, mesh_axes, tx)
    before = jax.device_get(state.params)  # `state` is donated to the step below
    new_state, metrics = step(state, batch)
  return before, jax.device_get(new_state), jax.device_get(metrics)


def assert_trees_close(got, want, *, rtol: float = 1e-5, what: str = ""):
  """Leafwise |got - want| <= rtol·|want| + rtol·max|want_leaf|: relative, with a floor at the leaf's scale
  (summation order moves near-zero entries by ~1e-7 of the leaf's largest entry)."""
  got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
  want_flat, want_def = jax.tree_util.tree_flatten(want)
  assert len(got_flat) == len(want_flat), f"{what}: trees differ in structure ({want_def})"
  for (path, g), w in zip(got_flat, want_flat, strict=True):
    w = np.asarray(w)
    np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * float(np.max(np.abs(w), initial=0.0)),
                               err_msg=f"{what}: leaf {jax.tree_util.keystr(path)}")


def max_rel_diff(got, want) -> float:
  """max over leaves of max|got - want| / max|want| (for reporting observed differences)."""
  return max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / max(float(np.max(np.abs(np.asarray(w)))), 1e-30))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
