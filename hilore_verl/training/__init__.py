"""One training session around each mini-batch of the actor update, and what it needs.

    config.py        HiLoReConfig: the `hilore:` section, the one user-facing config; RANGES per number
    session.py       Session: probe and calibrate once, plan, audit, out-of-memory retries, checkpoint state
    host.py          what a session needs from its host: Passes and Collectives (SingleProcess)
    calibration.py   the first mini-batch's measurements: cost table profiled, risk model calibrated; audits
    probe.py         which sequences the first step probes (token bound, half-size second probe)
    snapshots.py     putting a failed step back: FSDP2 state and gradients, the optimizer step's host snapshot
    staged_copy.py   device tensors into pageable host buffers through a fixed pinned ring

May import runtime, planner, loss, measure, kernels and validation; never verl or integration
(integration/actor drives a session from verl's engine, bench/ from its own loop).
"""
