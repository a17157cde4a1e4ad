"""The one loop driver: the settings schema every route reads (``settings``, ``settings_help``),
the step's phases in one order and the explaining of verdicts (``step``: ``StepDriver`` and its ``Seam``) and
their delivery (``delivery``), and the hook set for plain loops that the Accelerate, Fabric and
Trainer seams build on (``hooks``: ``SDCHooks``, with ``framework``, the questions it asks of a
loop; ``loop_checks``, its check cores and how they meet the model; ``replay_capture``, what the
replay records of the loop's forwards; ``counter_log``, the tracker points; ``hook_state``, its
checkpoint state). On every layer below; never on ``faults``."""
