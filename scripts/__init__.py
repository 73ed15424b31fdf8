"""Contributors' scripts: building the long-horizon tasks, keeping a sweep's records, writing
the generated docs pages, the repository's layer map, and one-off runs and calibrations."""
