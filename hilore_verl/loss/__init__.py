"""What the loss says about the update: which tokens it can feel and how much a lossy unit may move it.

    exposure.py   exposure summaries of the loss coefficients c = dL/dlog_prob, and their input checks
    risk.py       codec errors, calibrated unit sensitivities, the gradient audit, the risk budget
    skip.py       sequences the update leaves out (zero loss term), and the micro-batches of the rest

May import model, runtime and kernels; planner, training and integration import it.
"""
