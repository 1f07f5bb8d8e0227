"""Checks that run at start-up, before any model is built.

    checks.py     one check for every setting (type, range, finiteness; the message names the key)
    versions.py   the supported verl / torch ranges, read from installed metadata (never imports verl)

A leaf: imports nothing else of hilore_verl.
"""
