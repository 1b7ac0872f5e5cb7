"""The plan of a run: its stages in order with their inputs and fingerprints (`planner`), what a
fingerprint hashes (`fingerprints`), and which stages a run goes through (`selection`)."""
