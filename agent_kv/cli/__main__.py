"""`python -m agent_kv.cli`: the `agent-kv` command."""

import sys

from agent_kv.cli import main

sys.exit(main())
