"""Launchers: start and supervise the processes of a job."""
