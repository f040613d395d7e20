"""`python -m rekv_cli ...` is the `rekv` command."""

import sys

from rekv_cli.main import main

sys.exit(main())
