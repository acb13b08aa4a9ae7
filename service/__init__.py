"""service: what the entry points share (prepare a run, describe a model); imports only k6vsr_core and storage."""
