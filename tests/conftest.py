import os

# Ranks and tests run on CPU; keep each process to one BLAS/OpenMP thread on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
