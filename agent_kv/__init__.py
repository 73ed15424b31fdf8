"""agent_kv: a local LLM backend for long-horizon web agents (README.md).

The project installs four more top-level packages: `kernels`, `envs`, `tasks` and `api`. One
of those names is also a library transformers looks for: the Hugging Face Hub's `kernels`
(`transformers.utils.import_utils.is_kernels_available`), whose kernels it loads in place of
its own PyTorch code when it finds it. `tests/test_package_names.py` checks that the check
answers no for this project's `kernels`, and why.
"""
