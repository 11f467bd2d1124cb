"""Client-side helpers over JetStream's own gRPC client (tests, benchmarks/serve.py, users' scripts).

grpc and jetstream are imported where used: the core package imports without the extra
(tests/test_serving_optional.py imports every module but jetstream_engine).
"""

from __future__ import annotations

import time


def connect(port: int, host: str = "localhost"):
  """JetStream's OrchestratorStub for a server on host:port."""
  import grpc
  from jetstream.core.proto import jetstream_pb2_grpc

  return jetstream_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"{host}:{port}"))


def wait_live(stub, *, proc=None, log=None, timeout_s: float = 300.0) -> None:
  """Blocks until the server's HealthCheck says live. With `proc` (the server's Popen), raises at once
  if it exits, quoting the end of `log` (its output file, opened w+)."""
  import grpc
  from jetstream.core.proto import jetstream_pb2

  deadline = time.time() + timeout_s
  while True:
    try:
      if stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=5).is_live:
        return
    except grpc.RpcError:
      pass
    tail = ""
    if log is not None:
      log.seek(0)
      tail = log.read()[-3000:]
    if proc is not None and proc.poll() is not None:
      raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail}")
    if time.time() > deadline:
      raise TimeoutError(f"the server was not live after {timeout_s:.0f} s:\n{tail}")
    time.sleep(1)


def decode_ids(stub, ids, max_tokens: int, timeout_s: float = 600.0) -> list[int]:
  """A token request's answer, the stream's chunks joined."""
  from jetstream.core.proto import jetstream_pb2

  req = jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids),
                                    max_tokens=max_tokens)
  return [t for r in stub.Decode(req, timeout=timeout_s) for t in r.stream_content.samples[0].token_ids]
