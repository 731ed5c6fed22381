"""One module per phase of the job (docs/DESIGN.md, "The phase machine"): each ``step`` carries
the job through its phase and returns the next."""
