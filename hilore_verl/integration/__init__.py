"""Everything that touches verl lives under this package; nothing else in hilore_verl imports verl.

Importing it checks the installed verl and torch against the supported ranges first, so an
unsupported combination fails here with the ranges named, not deep inside verl.
"""

from hilore_verl.versions import SUPPORTED, UnsupportedVersionError, require_supported_versions

require_supported_versions()

__all__ = ["SUPPORTED", "UnsupportedVersionError", "require_supported_versions"]
