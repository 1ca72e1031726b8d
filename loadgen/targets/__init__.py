"""Load-generator targets: the live gateway (http), the in-process engine (inproc), the simulator (sim)."""
