"""`python -m paramserver` runs `diloco-server`."""

import sys

from paramserver.cli import main

sys.exit(main())
