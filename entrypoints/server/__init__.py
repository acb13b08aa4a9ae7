"""The parts of `k6vsr serve` (`entrypoints.http_api`): its configuration, errors, callers, fields, bodies and
routes."""
