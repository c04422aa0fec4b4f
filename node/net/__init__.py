"""The network between processes: the data-plane transport interface and its implementations
(gRPC, in-process for tests), framing, swarm authentication, link probes, control-plane errors."""
