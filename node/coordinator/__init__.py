"""`tahnode coordinator`: membership, placement of stages (probes + assignment search), the gRPC
service, and the status page with its JSON and metrics."""
