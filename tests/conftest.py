import os

# One OpenMP thread per process: the 2-rank tests run two processes on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
