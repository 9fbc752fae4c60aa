"""`python -m pipeflow …`: the same command line as `pipeflow …`."""

import sys

from pipeflow.cli import main

sys.exit(main())
