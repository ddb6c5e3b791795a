"""Training area: GRPO (RLVR) with spurious rewards and diversity shaping, AdaGC, pretraining, SFT."""
