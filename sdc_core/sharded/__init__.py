"""The FSDP2 (``fully_shard``), HSDP and tensor-parallel variants; docs/architecture.md lists them."""
