"""tahnode: pipeline-parallel LLM training across volunteers' GPUs over slow links.

Each daemon holds one pipeline stage; activations travel TAH-Quant compressed (see docs/)."""

__version__ = "0.1.0"
