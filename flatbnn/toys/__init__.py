"""Small exact problems behind the paper-figure reproductions (scripts/reproduce_*.py)."""
