"""The checks of one step: weight digests and fingerprints (``fingerprint``), the non-finite gradient
check and its tap (``gradients``), the matrix-product checksum (``matmul``), the every-step
gradient screen (``screen``). On ``dist``."""
