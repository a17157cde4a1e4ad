"""The one loop driver: the settings schema every route reads (``settings``, ``settings_help``),
the step order, carrying, explaining and delivery of verdicts (``step``: ``StepDriver`` and its
``Seam``), and the hook set for plain loops that the Accelerate, Fabric and Trainer seams build on
(``hooks``). On every layer below; never on ``faults``."""
