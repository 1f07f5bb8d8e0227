#!/usr/bin/env bash
# Apply hilore-verl's optional patches to the verl installed for `python` (default: python3).
#   patches/apply.sh [--check] [PYTHON]
# Each patch names the verl version it was written against; a patch that does not apply is
# reported and skipped (nothing is half-applied: every patch is checked before it is applied).
set -euo pipefail
check_only=false
if [[ "${1:-}" == "--check" ]]; then check_only=true; shift; fi
py="${1:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
site="$("$py" -c 'import os, verl; print(os.path.dirname(os.path.dirname(verl.__file__)))')"
version="$("$py" -c 'import verl; print(verl.__version__)')"
status=0
for p in "$here"/*.patch; do
  want="$(sed -n 's/^verl-version: //p' "$p")"
  if [[ "$want" != "$version" ]]; then
    echo "skip  $(basename "$p"): written for verl $want, installed verl is $version"; status=1; continue
  fi
  if patch -p1 -d "$site" --dry-run --forward --silent < "$p" > /dev/null; then
    if $check_only; then echo "ok    $(basename "$p") applies"; else
      patch -p1 -d "$site" --forward --silent < "$p"; echo "done  $(basename "$p")"; fi
  elif patch -p1 -d "$site" --dry-run --reverse --silent < "$p" > /dev/null; then
    echo "ok    $(basename "$p") is already applied"
  else
    echo "FAIL  $(basename "$p") does not apply to $site"; status=1
  fi
done
exit $status
