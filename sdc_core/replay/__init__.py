"""The ring replay audit (``ring``) and its parts; docs/architecture.md lists them. On ``checks`` and ``dist``."""
