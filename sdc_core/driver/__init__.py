"""The one loop driver: the settings every route reads (``settings``), the step's phases and verdicts (``step``) and
the hook set the Accelerate, Fabric and Trainer seams build on (``hooks``). Never imports ``faults``."""
