"""Framework-free pieces every front door runs inside the training loop (data position, RNG, staging fence,
schedule, plan, resume), and the plain-PyTorch front door built from them (checkpointer.py)."""
