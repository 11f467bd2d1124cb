"""The fixed-length workload of issue 12 beside Google Tunix's sampler, in one process: tokens/s of each.

  python benchmarks/tunix_compare.py [--batches=8,32] [--repeats=20] [--impl=tunix,dense,paged,paged:bucketed]

Needs `google-tunix` (0.1.7 measured), which the project does not install: it pulls tensorflow-datasets, grain,
numba and more. Give it a venv of its own beside this project's dependencies, with JAX and Flax pinned to the
project's pair, and run from the repository root (the commands RESULTS.md's numbers came from):

  python3 -m venv /tmp/tunix-venv
  /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 ml-collections
  PYTHONPATH=$PWD XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      /tmp/tunix-venv/bin/python benchmarks/tunix_compare.py

The workload (decode.py --workload=fixed): Llama-3 shape, 4 layers, d_model 256, 4 heads / 2 KV heads of 64, MLP
512, vocab 512, rope_theta 500,000, untied, fp32, random init (each implementation its own weights: throughput
does not depend on their values); B prompts of 32 random tokens; exactly 64 new tokens each (EOS unreachable);
temperature 1. tunix = `tunix.generate.sampler.Sampler` over `tunix.models.llama3.model.Llama3`, called as a user
would: prompts as strings through a tokenizer (here: token ids written as numbers), `top_p=1.0` (Tunix samples
with temperature only in its top-p mode), `max_prompt_length=32`, a cache of 96 tokens; dense and paged are
decode.py's runners. Each runs once untimed (compiles), then `--repeats` rounds, the implementations taking turns
within each round; tokens/s = B x 64 / the median wall. One JSON line per (impl, batch), with `vs_tunix`.
"""

import argparse
import datetime
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import decode  # noqa: E402  (this folder's decode.py: the workload and our runners)

from jaxrl_topo.models.model import init_params  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 32, 64


class _IdTokenizer:
  """Token ids written as space-separated numbers: what Tunix's sampler needs of a tokenizer, and no more."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self) -> int:
    return 0  # falsy: the sampler then prepends no BOS

  def eos_id(self) -> int:
    return decode.FIXED_MODEL.vocab_size  # out of the vocabulary: never sampled

  def pad_id(self) -> int:
    return 0


def tunix_runner(prompts, batch: int, seed: int):
  """Tunix's sampler on its own Llama3 of the workload's shape: a callable returning the generated token count."""
  from flax import nnx  # noqa: PLC0415
  from tunix.generate import sampler as tunix_sampler  # noqa: PLC0415  (optional: only this runner needs Tunix)
  from tunix.models.llama3 import model as tunix_llama  # noqa: PLC0415

  cfg = decode.FIXED_MODEL
  model = tunix_llama.Llama3(tunix_llama.ModelConfig(
      num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.d_model, hidden_dim=cfg.d_ff,
      num_heads=cfg.n_heads, head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads, rope_theta=int(cfg.rope_theta),
      norm_eps=1e-5, weight_tying=False), rngs=nnx.Rngs(seed))
  cache = tunix_sampler.CacheConfig(cache_size=PROMPT_LEN + NEW_TOKENS, num_layers=cfg.n_layers,
                                    num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
  sampler = tunix_sampler.Sampler(model, _IdTokenizer(), cache)
  texts = [" ".join(str(t) for t in p) for p in prompts]

  def once():
    out = sampler(texts, max_generation_steps=NEW_TOKENS, max_prompt_length=PROMPT_LEN, temperature=1.0, top_p=1.0,
                  seed=seed, eos_tokens=[cfg.vocab_size])
    n = sum(len(t.split()) for t in out.text)
    return n, NEW_TOKENS * batch, {}

  return once


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batches", default="8,32")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--impl", default="tunix,dense,paged,paged:bucketed",
                      help="comma-separated: tunix, dense, paged (the engine's default read), paged:<read>")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  impls = args.impl.split(",")
  if "tunix" not in impls:
    parser.error("--impl must include tunix (the comparison's baseline)")
  cfg = decode.FIXED_MODEL
  graphdef, params = init_params(cfg, jax.random.key(args.seed))
  # decode.py's runners read its parsed flags: the fixed-length workload at decode.py's defaults
  flags = decode.make_parser(jax.default_backend() == "gpu").parse_args(
      ["--workload=fixed", f"--prompt_len={PROMPT_LEN}", f"--new_tokens={NEW_TOKENS}", f"--seed={args.seed}"])
  common = {"bench": "tunix_compare", "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "date": datetime.date.today().isoformat(), "prompt_len": PROMPT_LEN,
            "new_tokens": NEW_TOKENS, "tunix": _tunix_version()}
  for batch in (int(b) for b in args.batches.split(",")):
    rng = np.random.default_rng(args.seed + 1_000_003 * batch)
    prompts = rng.integers(1, cfg.vocab_size, (batch, PROMPT_LEN)).tolist()
    lengths = np.full((batch,), NEW_TOKENS, np.int64)
    work = (graphdef, cfg, params, prompts, lengths, flags, batch, decode.SAMPLED)
    runs = {}
    for impl in impls:
      if impl == "tunix":
        runs[impl] = tunix_runner(prompts, batch, args.seed)
      elif impl == "dense":
        runs[impl] = decode.dense_runner(*work)
      else:
        runs[impl] = decode.paged_runner(*work, read=impl.partition(":")[2] or "auto")
    timings = decode.timed(runs, args.repeats)
    rate = {impl: batch * NEW_TOKENS / timings[impl][0] for impl in impls}
    for impl in impls:
      wall, walls, (tokens, _, _) = timings[impl]
      assert tokens == batch * NEW_TOKENS, f"{impl}: {tokens} tokens generated, {batch * NEW_TOKENS} asked"
      print(json.dumps({"impl": impl, "batch": batch, "tokens_per_s": rate[impl], "wall_s": wall,
                        "wall_s_all": walls, "vs_tunix": rate[impl] / rate["tunix"], **common}), flush=True)


def _tunix_version() -> str:
  from importlib import metadata  # noqa: PLC0415

  try:
    return metadata.version("google-tunix")
  except metadata.PackageNotFoundError:
    return "not installed"


if __name__ == "__main__":
  main()
