"""Issue 12's decode workloads beside Google Tunix's sampler, in one process: tokens/s of each.

  python benchmarks/tunix_compare.py [--batches=8,32] [--repeats=20] [--impl=tunix,dense,paged,paged:bucketed]
  python benchmarks/tunix_compare.py --workload=longtail [--batches=8,32] [--repeats=10]

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

`--workload=longtail`: the same model and sampling, but the lengths of decode.py's long-tail workload, the shape
of RL rollouts: 2B prompts, completion lengths lognormal with median 64 and log-sd 1, capped at 512. Tunix's
sampler and dense decode consecutive batches of B prompts, each batch to its longest length (max_generation_steps;
Tunix's cache holds the prompt plus the workload's longest completion, so it is not sized for the cap as a real
run's would be); the engine gets the 2B prompts as one call on B slots and refills a slot as soon as its sequence
ends. Tokens/s counts the drawn lengths only, not the padding steps past a row's length.
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


def tunix_runner(prompts, lengths, batch: int, seed: int):
  """Tunix's sampler on its own Llama3 of the workload's shape, over consecutive batches of `batch` prompts, each
  to its longest length: a callable returning (useful tokens, decode steps, {})."""
  from flax import nnx  # noqa: PLC0415
  from tunix.generate import sampler as tunix_sampler  # noqa: PLC0415  (optional: only this runner needs Tunix)
  from tunix.models.llama3 import model as tunix_llama  # noqa: PLC0415

  cfg = decode.FIXED_MODEL
  model = tunix_llama.Llama3(tunix_llama.ModelConfig(
      num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.d_model, hidden_dim=cfg.d_ff,
      num_heads=cfg.n_heads, head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads, rope_theta=int(cfg.rope_theta),
      norm_eps=1e-5, weight_tying=False), rngs=nnx.Rngs(seed))
  cache = tunix_sampler.CacheConfig(cache_size=PROMPT_LEN + int(max(lengths)), num_layers=cfg.n_layers,
                                    num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
  sampler = tunix_sampler.Sampler(model, _IdTokenizer(), cache)
  texts = [" ".join(str(t) for t in p) for p in prompts]
  batches = [(texts[i : i + batch], [int(n) for n in lengths[i : i + batch]]) for i in range(0, len(texts), batch)]

  def once():
    tokens = 0
    for rows, want in batches:
      out = sampler(rows, max_generation_steps=max(want), max_prompt_length=PROMPT_LEN, temperature=1.0, top_p=1.0,
                    seed=seed, eos_tokens=[cfg.vocab_size])
      tokens += sum(min(len(t.split()), n) for t, n in zip(out.text, want, strict=True))
    return tokens, sum(max(want) for _, want in batches), {}

  return once


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", default="fixed", choices=["fixed", "longtail"])
  parser.add_argument("--batches", default="8,32")
  parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median reported); default fixed 20, "
                      "longtail 10")
  parser.add_argument("--impl", default="tunix,dense,paged,paged:bucketed",
                      help="comma-separated: tunix, dense, paged (the engine's default read), paged:<read>")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  impls = args.impl.split(",")
  if "tunix" not in impls:
    parser.error("--impl must include tunix (the comparison's baseline)")
  fixed = args.workload == "fixed"
  repeats = args.repeats or (20 if fixed else 10)
  cfg = decode.FIXED_MODEL
  graphdef, params = init_params(cfg, jax.random.key(args.seed))
  # decode.py's runners read its parsed flags: the workload at decode.py's defaults (longtail: median 64, sigma 1)
  flags = decode.make_parser(jax.default_backend() == "gpu").parse_args(
      [f"--workload={args.workload}", f"--prompt_len={PROMPT_LEN}", f"--new_tokens={NEW_TOKENS}",
       f"--seed={args.seed}"])
  common = {"bench": "tunix_compare", "workload": args.workload, "device": jax.devices()[0].device_kind,
            "backend": jax.default_backend(), "jax": jax.__version__, "date": datetime.date.today().isoformat(),
            "prompt_len": PROMPT_LEN, "tunix": _tunix_version()}
  for batch in (int(b) for b in args.batches.split(",")):
    rng = np.random.default_rng(args.seed + 1_000_003 * batch)
    if fixed:
      lengths = np.full((batch,), NEW_TOKENS, np.int64)
    else:
      lengths = decode.sample_lengths(2 * batch, flags.median_len, flags.sigma, args.seed + batch)
    prompts = rng.integers(1, cfg.vocab_size, (len(lengths), PROMPT_LEN)).tolist()
    work = (graphdef, cfg, params, prompts, lengths, flags, batch, decode.SAMPLED)
    runs = {}
    for impl in impls:
      if impl == "tunix":
        runs[impl] = tunix_runner(prompts, lengths, batch, args.seed)
      elif impl == "dense":
        runs[impl] = decode.dense_runner(*work)
      else:
        runs[impl] = decode.paged_runner(*work, read=impl.partition(":")[2] or "auto")
    timings = decode.timed(runs, repeats)
    want = int(lengths.sum())
    rate = {impl: want / timings[impl][0] for impl in impls}
    for impl in impls:
      wall, walls, (tokens, _, _) = timings[impl]
      assert tokens == want, f"{impl}: {tokens} tokens generated, {want} asked"
      print(json.dumps({"impl": impl, "batch": batch, "n_seqs": len(lengths), "tokens": want,
                        "max_len": int(lengths.max()), "tokens_per_s": rate[impl], "wall_s": wall, "wall_s_all": walls,
                        "vs_tunix": rate[impl] / rate["tunix"], **common}), flush=True)


def _tunix_version() -> str:
  from importlib import metadata  # noqa: PLC0415

  try:
    return metadata.version("google-tunix")
  except metadata.PackageNotFoundError:
    return "not installed"


if __name__ == "__main__":
  main()
