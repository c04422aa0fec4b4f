"""One pipeline stage at work: the worker (forward, backward, commit, replay), stage 0's step
driver, its schedule, the step's state, per-stream codec state, and the stage's checkpoints."""
