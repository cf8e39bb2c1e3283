"""One script per measured claim: `.venv/bin/python -m benchmarks.NAME --help`."""
