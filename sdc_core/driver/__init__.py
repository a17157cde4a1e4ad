"""The one loop driver: the settings schema every route reads (``settings``), the step's phases and verdicts
(``step``: ``StepDriver``, ``Delivery``), and the hook set for plain loops that the Accelerate, Fabric and Trainer
seams build on (``hooks`` and its collaborators; docs/architecture.md lists them). On every layer below; never on
``faults``."""
