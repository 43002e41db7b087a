"""The scheduling core: plain Python, no Django, shared by the live service and the simulator."""
