"""Framework-free pieces every front door runs inside the training loop: data position, RNG, staging fence."""
