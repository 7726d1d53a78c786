"""`python -m experiments.launch`: runs a sweep's work units as local processes (experiments/launch/local.py)."""
from experiments.launch import local

if __name__ == "__main__":
  raise SystemExit(local.main())
