"""`k6vsr serve`: its app and server (`app`), and their parts: configuration, errors, callers, fields, bodies and
routes."""
