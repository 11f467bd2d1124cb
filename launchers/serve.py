"""Serve a policy through JetStream's orchestrator and gRPC server (needs the jetstream extra).

  pip install -e '.[jetstream]'        # once: google-jetstream 0.2.2 (pulls TensorFlow, about 3 GB)
  python launchers/serve.py --model=DIR [--port=9000]          # an HF directory
  python launchers/serve.py --workdir=RUN [--port=9000]        # a training run's newest checkpoint
  python launchers/serve.py --workdir=RUN --follow_s=60        # ... and each newer one as the run saves it

Clients speak JetStream's protocol (jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub: Decode,
HealthCheck), with text (the model's tokenizer.json) or token ids. The engine is the RL loop's paged
rollout engine on a rollout mesh of --data x --tensor devices (--read, --kv_dtype, --min_pack_rows,
--min_window_tokens and --pallas_splits set its knobs, as in launchers/generate.py). Greedy by default;
--nogreedy samples with --temperature, --top_p, --top_k and --min_p. Ctrl-C or SIGTERM stops the server;
SIGUSR1 prints every thread's stack.
"""

import faulthandler
import os
import signal
import threading
from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli
from jaxrl_topo.rollout.paged import READ_HELP, READS

_MODEL = flags.DEFINE_string("model", None, "Local HF directory (config.json, *.safetensors, tokenizer.json).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A run of launchers/train.py: serve its newest checkpoint.")
_PORT = flags.DEFINE_integer("port", 9000, "gRPC port on this host.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Concurrent sequences (JetStream's max_concurrent_decodes).")
_MAX_LEN = flags.DEFINE_integer("max_len", 512, "Prompt + completion tokens per sequence (within the model's limit).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Cap per request; a request's max_tokens cuts earlier.")
_CHUNK = flags.DEFINE_integer("decode_chunk", 8, "Decode steps per device call.")
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page (--max_len is rounded down to a whole page).")
_DATA = flags.DEFINE_integer("data", 1, "Data-parallel width of the rollout mesh (splits the slots).")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Tensor-parallel width of the rollout mesh.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_GREEDY = flags.DEFINE_bool("greedy", True, "Arg-max decoding; --nogreedy samples at --temperature.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature when sampling.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "With --nogreedy: nucleus mass in (0, 1]; 1 = off.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "With --nogreedy: keep the k most likely tokens; 0 = off.")
_MIN_P = flags.DEFINE_float("min_p", 0.0, "With --nogreedy: keep tokens with p >= min_p * max p; 0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_FOLLOW = flags.DEFINE_float("follow_s", 0.0, "With --workdir: every N seconds, swap in the run's newest "
                             "checkpoint if it is newer (gen_id = its step); 0 = serve one checkpoint.")
_POLICY = flags.DEFINE_enum("policy", "finish_on_old", ["keep_kv", "finish_on_old", "abort_and_resume"],
                            "How a hot weight swap lands (JetStreamEngine.swap_weights).")
_READ = flags.DEFINE_enum("read", "auto", list(READS), READ_HELP)
_ENGINE = cli.define_engine_flags()


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from jaxrl_topo.serving import server

  server.require_jetstream()
  sc = server.ServeConfig(slots=_SLOTS.value, max_len=_MAX_LEN.value, max_new_tokens=_MAX_NEW.value,
                          decode_chunk=_CHUNK.value, page_size=_PAGE.value, data=_DATA.value, tensor=_TENSOR.value,
                          dtype=_DTYPE.value,
                          greedy=_GREEDY.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                          min_p=_MIN_P.value, seed=_SEED.value, policy=_POLICY.value,
                          read=_READ.value, engine=_ENGINE())
  server.check_port(_PORT.value)  # before loading anything
  if _FOLLOW.value and not _WORKDIR.value:
    raise ValueError("--follow_s needs --workdir (a run whose new checkpoints to serve)")
  step = server.newest_step(_WORKDIR.value) if _WORKDIR.value and os.path.isdir(_WORKDIR.value) else None
  model_dir = server.resolve_model_dir(_MODEL.value, _WORKDIR.value)
  js_engine, _ = server.build_engine(model_dir, sc, gen_id=step or 0)
  srv = server.start(js_engine, _PORT.value)
  print(f"serving {model_dir} on port {_PORT.value}, all interfaces (localhost:{_PORT.value} here; {sc.slots} slots, "
        f"data={sc.data} x tensor={sc.tensor}, decode read {js_engine.engine.impl}); "
        "Ctrl-C or SIGTERM stops", flush=True)
  faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack (a stuck server)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  if _FOLLOW.value:
    threading.Thread(target=server.follow_run, args=(js_engine, _WORKDIR.value, sc, stop),
                     kwargs=dict(every_s=_FOLLOW.value, served_step=step), daemon=True).start()
  stop.wait()
  # JetStream's stop drains its queues in a busy loop until its threads see a sentinel: bounded here, so
  # SIGTERM always ends the process (its threads hold nothing that outlives it).
  stopper = threading.Thread(target=srv.stop, daemon=True)
  stopper.start()
  stopper.join(timeout=30)
  print("server stopped" if not stopper.is_alive() else "server stopped (JetStream's shutdown cut after 30 s)",
        flush=True)
  if stopper.is_alive():
    os._exit(0)


if __name__ == "__main__":
  cli.launch(main)
