"""The web page at `/`: sign in, submit, watch, cancel and browse jobs through the same API as any client."""
