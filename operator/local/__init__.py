"""local: specdecode up's backend — runtime processes and a router on one machine."""
