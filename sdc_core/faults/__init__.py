"""Fault injection and campaigns, beside the driver and never below it (docs/architecture.md lists the modules).
Imported only by itself, the CLI and the adapters."""
