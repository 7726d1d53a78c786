"""`python -m experiments.launch`: runs a sweep's work units as local processes (experiments.launch.local.local.local)."""
from experiments.launch.local.local import local

if __name__ == "__main__":
  raise SystemExit(local.main())
