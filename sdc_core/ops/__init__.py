"""After the verdict: ``incidents``, ``process_exit``, ``launch``, ``rollback`` (docs/architecture.md); on dist, io."""
