"""entrypoints: what users run (the `k6vsr` command, the HTTP API and its job runner, the demo); nothing imports them."""
