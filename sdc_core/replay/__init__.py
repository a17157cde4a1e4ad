"""The ring replay audit (``ring``) and its parts, from the state a step reads (``state``) to the referee
round (``referee``) and a screen hit's confirmation (``confirm``); docs/architecture.md lists them. On ``checks``
and ``dist``."""
