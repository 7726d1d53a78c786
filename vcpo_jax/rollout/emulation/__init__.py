"""The lag emulator (rl.mode=emulate): in-process rollouts from past params, its lag models and ring store."""
