"""`python -m experiments.launch`: the sweep launcher of experiments/launch.py."""
import sys

from experiments import launch

sys.exit(launch.main())
