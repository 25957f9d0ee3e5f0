"""Fine-tuning as an API: jobs (jobs.py), their dispatcher (runner.py), and the adapter-only
registry versions and `ft:` ids of their results (adapters.py). The flow a job runs is
flows/fine_tuning.py; the routes are tuneloop/api/fine_tuning.py."""
