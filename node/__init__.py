"""tahnode: pipeline-parallel LLM training across volunteers' GPUs over slow links.

Each daemon holds one pipeline stage; activations travel TAH-Quant compressed (see docs/)."""

import os

# A daemon forks hivemind's DHT and averager processes while its gRPC servers and channels run (once
# pipelines train in data parallel). gRPC's fork handlers skip themselves while other threads are in
# gRPC, and the child then died in gRPC's event-engine thread (a segfault seen in every first DHT a
# training stage started); without them the child holds gRPC's memory but runs none of it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
