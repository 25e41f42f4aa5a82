"""`python -m paramserver` runs `diloco-server`."""

import sys

from paramserver.ops.cli import main

sys.exit(main())
