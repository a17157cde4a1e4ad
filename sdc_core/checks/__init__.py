"""The checks of one step and their contract (``contract``): digests and the weight fingerprint, the local-gradient
tap and reductions, the non-finite gradient check, the matrix-product checksum and the every-step gradient screen;
docs/architecture.md lists the modules. On ``dist``."""
