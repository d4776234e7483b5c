"""Pipeline schedules as plain data and their simulation (no process groups)."""
