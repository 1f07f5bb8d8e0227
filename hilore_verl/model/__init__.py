"""What a recovery unit is and how a model is cut into units.

    units.py       the recovery units of a Hugging Face decoder-only LM, named and ordered
    unit_maps.py   which modules of a decoder block make each unit, declared per model family

Imports torch and transformers only; runtime, planner, loss and integration import it.
"""
