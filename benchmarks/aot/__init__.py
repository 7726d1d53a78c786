"""Ahead-of-time compiles of the learner step (and decode) for a GPU or TPU slice from this CPU machine."""
