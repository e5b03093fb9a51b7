"""Keeping the job alive and saying what broke."""
