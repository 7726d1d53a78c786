"""The horizon study (docs/results/horizon/): its sweep, page, and the estimator-variance mechanism runs."""
