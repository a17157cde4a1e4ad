"""After the verdict: incident records, their report and exit code (``incidents``), the ``sdc run``
launcher (``launch``). On ``dist`` and ``io``."""
