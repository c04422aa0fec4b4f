"""tahnode: pipeline-parallel LLM training across volunteers' GPUs over slow links.

Each daemon holds one pipeline stage; activations travel TAH-Quant compressed (see docs/)."""

import os

# hivemind's DHT and averager processes start from a forkserver (tahnode.net.clean_start), never forked
# from a daemon whose gRPC threads run; gRPC's fork handlers stay off for any fork that remains (a
# multiprocessing helper, a test's): with them on, a child forked while other threads were in gRPC
# died in gRPC's event-engine thread.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
