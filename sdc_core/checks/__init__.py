"""The checks of one step: the check contract (``contract``: the phases, a check's role,
``StepCheck``), tensor digests (``digest``) and the weight fingerprint (``fingerprint``),
the local-gradient tap (``gradient_tap``), read-only gradient reductions (``reductions``), the
non-finite gradient check (``gradients``), the matrix-product checksum (``matmul``: its rounding
bound in ``matmul_bound``, the hooked products in ``matmul_sites``), the every-step gradient
screen (``screen``: its rows and their all_gather; ``screen_rule``: how they are judged). On ``dist``."""
