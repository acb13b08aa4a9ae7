"""The `k6vsr` commands, one module per group: `entrypoints.cli` imports a command's module only when it runs."""
