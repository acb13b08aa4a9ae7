"""tasks: thin Prefect tasks, one per stage; each reads from the run store, calls k6vsr_core and writes back."""
