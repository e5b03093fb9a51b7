"""Warm recovery: the survivors of a lost rank re-form the group with a warm spare."""
