"""Problems from files: reading the verl schema and plain rows, verifiers, and the demo's generated word problems."""
