"""hilore-verl tests (a package, so that spawned ranks can import test functions by name)."""
