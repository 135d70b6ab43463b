"""Input and output side of the mesh: protocol requests <-> token ids (deepseek-recipe)."""
