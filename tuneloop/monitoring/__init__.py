"""The loop's eyes: drift of served prompts against the champion's training prompts
(drift.py), service health against SLOs (slo.py), and one monitoring run that puts them
together, writes the reports and says which events to emit (run.py). Plain Python: the
Prefect flow (flows/monitoring.py) and `tuneloop monitor` both call run.monitor()."""
