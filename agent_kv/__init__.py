"""agent_kv: a local LLM backend for long-horizon web agents (README.md).

The project installs four more top-level packages: `kernels`, `envs`, `tasks` and `api`. One
of those names is also a library transformers looks for: the Hugging Face Hub's `kernels`
(`transformers.utils.import_utils.is_kernels_available`), whose kernels it loads in place of
its own PyTorch code when it finds it. Importing this package switches transformers' Hub
kernels off (`USE_HUB_KERNELS=NO`) before any of its modules imports transformers, so this
project's `kernels` is never taken for that library (`tests/test_package_names.py`).
"""

import os

os.environ["USE_HUB_KERNELS"] = "NO"
