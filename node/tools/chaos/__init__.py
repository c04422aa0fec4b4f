"""`tahnode bench chaos`'s parts (tahnode.tools.bench_chaos is the command): the seeded fault schedule
(faults), the swarm it breaks (daemons), the run that applies the schedule and records it (run, record),
and what the record comes to (figures, report)."""
