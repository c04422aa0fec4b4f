"""The p2p transport (libp2p through hivemind's p2p daemon, for volunteers behind NAT): its host, the records
and streams it frames, relayed links, gRPC over those streams, the callers' checks, and the transport itself."""
