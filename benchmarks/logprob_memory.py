"""Compiled memory of value-and-grad of sum(log-probs): explicit [N, V] logits vs the chunked scan.

  python benchmarks/logprob_memory.py [--tokens=4096,16384] [--chunks=256,1024,4096] [--dtype=float32]

AOT only (`jit(f).lower(ShapeDtypeStructs).compile().memory_analysis()`): nothing is allocated, so
the naive case at 16k tokens (10 GB of fp32 logits) is safe to "run" on a laptop CPU; ~20 s on 2
cores. Qwen2.5-0.5B shapes: D = 896, V = 151936. Prints one JSON line per (impl, chunk, tokens);
temp_bytes is XLA's scratch (logits, their cotangent, softmax), argument_bytes is h + w + targets.
"""

import argparse
import json

import jax
import jax.numpy as jnp

from jaxrl_topo.train.logprobs import chunked_logprobs, logprobs_from_logits

VOCAB, D_MODEL = 151936, 896  # Qwen2.5-0.5B


def _naive(h_ND, w_DV, t_N):
  logits_NV = jnp.einsum("ND,DV->NV", h_ND, w_DV, preferred_element_type=jnp.float32)
  return logprobs_from_logits(logits_NV, t_N)[0]


def memory(impl, tokens: int, dtype):
  """memory_analysis() of grad of sum(logp) w.r.t. (h, w), compiled for abstract inputs."""
  args = (jax.ShapeDtypeStruct((tokens, D_MODEL), dtype), jax.ShapeDtypeStruct((D_MODEL, VOCAB), dtype),
          jax.ShapeDtypeStruct((tokens,), jnp.int32))
  f = jax.value_and_grad(lambda h, w, t: jnp.sum(impl(h, w, t)), argnums=(0, 1))
  return jax.jit(f).lower(*args).compile().memory_analysis()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", default="4096,16384", help="comma-separated token counts N")
  parser.add_argument("--chunks", default="256,1024,4096", help="comma-separated chunk sizes C")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of h and w")
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  chunks = [int(c) for c in args.chunks.split(",")]
  common = {"vocab": VOCAB, "d_model": D_MODEL, "dtype": args.dtype, "jax": jax.__version__,
            "device": jax.devices()[0].device_kind}
  for tokens in (int(n) for n in args.tokens.split(",")):
    runs = [("naive", None, _naive)]
    runs += [("chunked", c, lambda h, w, t, c=c: chunked_logprobs(h, w, t, chunk=c)[0]) for c in chunks]
    for impl, chunk, fn in runs:
      stats = memory(fn, tokens, dtype)
      print(json.dumps({"impl": impl, "chunk": chunk, "tokens": tokens, **common,
                        "temp_bytes": None if stats is None else stats.temp_size_in_bytes,
                        "argument_bytes": None if stats is None else stats.argument_size_in_bytes}), flush=True)


if __name__ == "__main__":
  main()
