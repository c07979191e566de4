"""`python -m tailored.bench ...` = `tailored bench ...` (works before the CLI wiring)."""

import sys

from tailored.bench.cli import main

sys.exit(main())
