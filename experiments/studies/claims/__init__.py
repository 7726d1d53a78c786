"""The claims study (docs/results/study/): its base config, sweeps and the calibration pilot's page."""
