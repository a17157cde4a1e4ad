"""The ring replay: what a step reads besides its batch (``state``), its side-effect-free re-run
(``rerun``), collectives refused inside it (``guard``), deterministic kernels (``determinism``),
digests and comparison (``compare``), what the audits learnt (``calibration``), what ranks send and
who is to blame (``attribution``), one audited step (``audit``) and its referee round (``referee``),
the audit itself (``ring``), and a screen hit confirmed by a partner's recomputation (``confirm``).
On ``checks`` and ``dist``."""
