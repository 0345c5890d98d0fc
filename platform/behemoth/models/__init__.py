"""Model builders. One file per model family; `registry.py` maps names to builders."""
