"""`python -m mlacheck.report results.jsonl [-o outdir]` (same as `mlacheck report`)."""

import sys

from mlacheck.report.cli import main

sys.exit(main())
