"""Files: ``safe_files``, ``checkpoints`` (docs/architecture.md says what each holds). On ``dist`` and the checks."""
