"""What every ``pdserve bench`` command shares: the result file (machine, versions, commit, raw JSON),
the percentile and goodput arithmetic, the load generator (open and closed loop, streaming and not) and
the watch on a stack's processes. Each bench adds its workload and its report and nothing else."""
