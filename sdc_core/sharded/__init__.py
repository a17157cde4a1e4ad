"""The FSDP2 (``fully_shard``) variants: the witness rule (``replicas``), the reduce-scatter's
gradient tap (``tap``), the non-finite check and fingerprint over shards (``checks``), the
sharded replay (``replay``) and the update audit (``update_audit``). On ``replay`` and ``checks``."""
