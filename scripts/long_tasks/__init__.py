"""The long-horizon task suites (`tasks/long/`), built from the bundled sites' data: scripted
histories that carry a fact across many pages, the probes that fitted them to the default
model, and the sweep's records kept in the repository."""
