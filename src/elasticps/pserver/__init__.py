"""The parameter server: one shard of the parameters and its optimizer state."""
