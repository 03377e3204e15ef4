"""What every ``pdserve bench`` command shares: the result file (machine, versions, commit, raw JSON)
and the percentile arithmetic. Each bench adds its workload and its report and nothing else."""
