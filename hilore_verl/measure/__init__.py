"""Measuring: device time, memory peaks and confidence intervals, one clock and one meter each.

    timing.py        device time (CUDA events on a GPU, a host clock on the CPU) for every profiling figure
    peak_memory.py   a mini-batch's measured peak; a call's allocations from the profiler's events
    host_memory.py   this process's and this host's memory (resident size, its high-water mark)
    intervals.py     95% confidence intervals of means and of paired ratios (bench rounds, measured trial)

Imports torch and psutil only (a leaf); every other package may import it.
"""
