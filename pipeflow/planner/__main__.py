"""`python -m pipeflow.planner`: the `pipeflow plan` command before it is wired into the CLI."""

import sys

from pipeflow.planner.cli import main

sys.exit(main())
