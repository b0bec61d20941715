"""`python -m dflash_serve.services.cli`: the `dflash` command."""

import sys

from dflash_serve.services.cli import main

sys.exit(main())
