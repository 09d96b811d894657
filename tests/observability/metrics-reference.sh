#!/usr/bin/env bash
# docs/metrics.md against the metrics the code registers (both directions), and the dashboard,
# the rules and their tests against the code; alerts' runbooks against docs/operations.md.
# Needs python3 with PyYAML (Debian: python3-yaml). No build needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 tests/observability/metrics_reference.py
