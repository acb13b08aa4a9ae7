"""entrypoints: what users run (the `k6vsr` command, the HTTP API with its job runner, the demo); imported by none."""
