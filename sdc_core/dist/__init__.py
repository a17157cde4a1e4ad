"""Between ranks and processes: ``topology``, ``payload``, ``payload_checks`` (docs/architecture.md says what
each holds). Imports only the package's leaves."""
