"""Files: atomic writes and weights-only reads (``safe_files``); reading, writing and verifying
checkpoints and their fingerprints (``checkpoints``). On ``dist`` and the checks' digests."""
