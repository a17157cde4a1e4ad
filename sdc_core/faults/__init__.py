"""Fault injection, beside the driver and never below it: bit flips and the injector (``inject``),
checkpoint alteration (``checkpoint``). Imported only by itself, the CLI and the adapters."""
