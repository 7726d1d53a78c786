"""Statistics over finished runs: confidence intervals and IQM, claim numbers, pre-registered verdicts, report pages."""
