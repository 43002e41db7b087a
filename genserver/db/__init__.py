"""Database backends of our own (Django loads one by its ENGINE path)."""
