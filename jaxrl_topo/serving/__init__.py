"""Serving the policy through JetStream (the optional `jetstream` extra).

`jetstream_engine.py` adapts the paged rollout engine to JetStream's `engine_api.Engine`;
`server.py` loads a model or a run's checkpoint and starts JetStream's orchestrator and gRPC server
(`launchers/serve.py`). Both import `jetstream`; nothing in the core package imports this room.
"""
