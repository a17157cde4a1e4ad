"""After the verdict: incident records and their report (``incidents``), how a process ends on one
(``process_exit``), the ``sdc run`` launcher (``launch``). On ``dist`` and ``io``."""
