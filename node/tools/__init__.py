"""Commands built on the rest of tahnode: the one-machine demo (`tahnode demo`), codec evaluation
(`tahnode codec eval`) and the benchmarks (`tahnode bench ...`)."""
