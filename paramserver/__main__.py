"""`python -m paramserver` runs `diloco-server`."""

import sys

from paramserver.server.cli import main

sys.exit(main())
