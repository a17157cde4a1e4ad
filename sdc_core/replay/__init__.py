"""The ring replay: state capture and side-effect-free re-runs (``state``), digests and comparison
(``compare``), what ranks send and who is to blame (``attribution``), the audit itself
(``ring``), and a screen hit confirmed by a partner's recomputation (``confirm``). On ``checks``
and ``dist``."""
